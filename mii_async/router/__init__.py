"""The router process: clients in, replicas out, tokens streamed back (server.py around the core, core.py)."""
