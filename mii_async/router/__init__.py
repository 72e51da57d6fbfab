"""The router side: incremental detokenization (used by the local pipeline too)."""
