"""Model families over shared blocks: config.json → a spec (loader.py, spec.py), its `architectures` → the class
that runs it (registry.py), one file per architecture (llama.py, qwen3.py, gemma.py, phi3.py, …; docs/models.md)
over the decoder skeleton (decoder.py) and the blocks (layers/), each rank's slice of the weights (weights.py,
shard_plan.py) and its process group (parallel.py)."""
from __future__ import annotations
