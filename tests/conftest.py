"""Shared fixtures: the default model (converted once), a shared pipeline, tiny random-weight HF models."""
from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Callable

import pytest

TINY_KINDS = ("llama", "llama3", "mistral", "qwen2")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from mii_async.config import default_cache_dir
    from mii_async.model_source import resolve_model

    return resolve_model(None, default_cache_dir())


@pytest.fixture(scope="session")
def default_pipe(default_model_dir):
    import mii_async

    pipe = mii_async.pipeline(str(default_model_dir))
    yield pipe
    pipe.close()


@pytest.fixture(scope="session")
def deployment(default_model_dir):
    """A real deployment of the default model: a router process and one worker process."""
    import mii_async
    from tests.mesh_helpers import deployment_pids, wait_gone

    client = mii_async.serve(str(default_model_dir), kv_cache_memory=0.1)
    pids = [client._process.pid] + deployment_pids(client.run(client.health()))
    yield client
    client.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"


@pytest.fixture(scope="session")
def start_gateway(deployment):
    """Starts a gateway process with the given HttpConfig fields (port: any free one); stops them all at the end."""
    from mii_async.config import HttpConfig
    from mii_async.deployment import GatewayProcess
    from tests.mesh_helpers import wait_gone

    started = []

    def start(tokenizer=None, **http):
        gw = GatewayProcess(deployment.address, HttpConfig(**{"http_port": 0, **http}), tokenizer=tokenizer)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()
    assert not wait_gone([gw.pid for gw in started]), "gateway processes left behind"


@pytest.fixture(scope="session")
def gateway_url(start_gateway) -> str:
    """The base URL (http://127.0.0.1:PORT) of a gateway with the default settings and no API key."""
    return start_gateway().url


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()


def build_tiny(kind: str, out: Path) -> Path:
    """A random-weight model of `kind` saved as safetensors (biases randomised too, so they are tested)."""
    import torch
    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config)

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0)
    elif kind == "llama3":
        cfg = LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                                  "rope_theta": 500000.0}, rope_theta=500000.0)
    elif kind == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif kind == "qwen2":
        cfg = Qwen2Config(**{**common, "num_key_value_heads": 2}, tie_word_embeddings=True)
    else:
        raise ValueError(kind)
    torch.manual_seed(zlib.crc32(kind.encode()) % 1000)   # not hash(): it differs per process
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = build_tiny(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return made[kind]

    return get


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
