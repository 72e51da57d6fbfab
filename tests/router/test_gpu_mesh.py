"""The mesh on CUDA: a router and a worker process serving through the same code path as on the CPU."""
from __future__ import annotations

import pytest

import mii_async
from tests.mesh_helpers import deployment_pids, wait_gone, with_word_tokenizer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_serve_on_cuda_equals_pipeline(kind, tiny_model, tmp_path):
    """serve() on the GPU (tensor_parallel auto → 1 on one GPU) streams the in-process engine's greedy tokens."""
    path = with_word_tokenizer(tiny_model(kind), tmp_path / kind)
    prompts = [[1, 5, 9, 33, 70, 12, 8], [1, 200, 3, 4], [1, 17, 17, 250, 31, 99]]
    with mii_async.pipeline(str(path), device="cuda", dtype="float32", num_blocks=64) as pipe:
        want = [r.token_ids for r in pipe(prompts, max_new_tokens=24, ignore_eos=True)]
    client = mii_async.serve(str(path), device="cuda", dtype="float32", num_blocks=64)
    try:
        h = client.run(client.health())
        pids = [client._process.pid] + deployment_pids(h)
        assert h["tensor_parallel"] == 1 and h["replicas"][0]["device"].startswith("cuda")
        got = client(prompts, max_new_tokens=24, ignore_eos=True)
        assert [r.token_ids for r in got] == want
        text = "".join(c.text for c in client.run(_stream(client, [1, 5, 9, 33])))
        assert text and "\ufffd" not in text
    finally:
        client.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids)


async def _stream(client, prompt):
    return [c async for c in client.stream(prompt, max_new_tokens=8, ignore_eos=True)]
