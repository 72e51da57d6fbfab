"""Model families. Each maps an HF config to a spec, loads its weights and runs a forward pass on the op set."""
from __future__ import annotations

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
