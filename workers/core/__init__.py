"""The engine's decisions on ints and lists: scheduler, block manager, sequences, step plan. No torch here."""
