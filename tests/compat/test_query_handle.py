"""mii_query_handle(model, tensor_parallel=T): in process for T = 1, a local deployment for T > 1 that the
handle stops; query() takes prompts= , a positional list or DeepSpeed-MII's {"query": [...]}, and max_length."""
from __future__ import annotations

import asyncio
import inspect

import pytest

import mii_async
from tests.mesh_helpers import wait_gone

PROMPTS = ["w5 w9 w33", "w7"]


def test_tensor_parallel_2_is_a_deployment_the_handle_stops(tiny_llama):
    """T = 2 answers what the in-process engine answers, from plain code and awaited; close() stops every
    process of the deployment."""
    with mii_async.pipeline(str(tiny_llama)) as pipe:
        want = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=8, ignore_eos=True)]
    handle = mii_async.mii_query_handle(str(tiny_llama), tensor_parallel=2, num_blocks=64)
    client = handle._client
    pids = [client._process.pid] + [p for r in client.health()["replicas"] for p in r["pids"]]
    try:
        assert len(pids) == 3
        assert [r.token_ids for r in handle.query(prompts=PROMPTS, max_new_tokens=8, ignore_eos=True)] == want
        assert [r.token_ids for r in handle.query({"query": PROMPTS}, max_new_tokens=8, ignore_eos=True)] == want

        async def main():
            pending = handle.query(PROMPTS, max_new_tokens=8, ignore_eos=True)
            assert inspect.isawaitable(pending)
            return await pending

        assert [r.token_ids for r in asyncio.run(main())] == want
    finally:
        handle.close()
    assert not wait_gone(pids, timeout_s=30), "the handle left processes running"
    handle.close()                                  # idempotent


def test_in_process_handle_takes_max_length(tiny_llama):
    """T = 1: max_length bounds prompt + output tokens (finish_reason "length"), from plain code and awaited;
    a prompt that leaves no room is refused naming max_length."""
    with mii_async.mii_query_handle(str(tiny_llama), num_blocks=64) as handle:
        [full] = handle.query(prompts=[PROMPTS[0]], max_new_tokens=12, ignore_eos=True)
        [capped] = handle.query(prompts=[PROMPTS[0]], max_length=full.prompt_length + 4, ignore_eos=True)
        assert capped.token_ids == full.token_ids[:4] and capped.finish_reason == "length"
        assert capped.generated_length == 4 and capped.usage.completion_tokens == 4

        async def main():
            return await handle.query(PROMPTS[0], max_length=full.prompt_length + 2, ignore_eos=True)

        [awaited] = asyncio.run(main())
        assert awaited.token_ids == full.token_ids[:2]
        with pytest.raises(mii_async.InvalidParameterError, match="no room") as e:
            handle.query(prompts=[PROMPTS[0]], max_length=full.prompt_length)
        assert e.value.param == "max_length"
        with pytest.raises(mii_async.InvalidParameterError) as e:
            handle.query({"prompts": PROMPTS})
        assert e.value.param == "request"
