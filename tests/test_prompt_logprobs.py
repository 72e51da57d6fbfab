"""Prompt logprobs end to end on a tiny random model: through the real client, router and worker process, and
through the local pipeline, each prompt token's logprob and top n equal transformers' log-softmax of the prompt
logits on the same weights (fp32), in `generate` and in the first chunk of `stream`."""
from __future__ import annotations

import asyncio
import random

import pytest

import mii_async
from tests.mesh_helpers import deployment_pids, wait_gone, with_word_tokenizer

TOP = 3


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    return with_word_tokenizer(tiny_model("llama"), tmp_path_factory.mktemp("plp") / "tiny")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[1] + [rng.randrange(3, 320) for _ in range(n)] for n in (0, 1, 12, 37)]


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    """transformers' own log-softmax of each prompt's logits: (logprob of token i given the ones before, the
    top TOP (ids, logprobs) there) for i ≥ 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)    # [P, V]
            out.append([None] + [(lp[i - 1, p[i]].item(), torch.topk(lp[i - 1], TOP)) for i in range(1, len(p))])
    return out


def _check(got, want, prompt):
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        own, top = want[i]
        assert got[i].token_id == prompt[i]
        assert got[i].logprob == pytest.approx(own, rel=1e-4, abs=1e-5), i
        assert [t for t, _ in got[i].top] == top.indices.tolist(), i
        assert [v for _, v in got[i].top] == pytest.approx(top.values.tolist(), rel=1e-4, abs=1e-5), i


def test_prompt_logprobs_through_the_mesh(model_dir, prompts, expected):
    """client.generate(…, prompt_logprobs=3) through a router and a worker process gives transformers'
    prompt logprobs, with sampled logprobs beside them; a stream carries them (and the prompt's ids) on its
    first chunk only; without prompt_logprobs the field is None and the tokens are the same."""
    client = mii_async.serve(str(model_dir), num_blocks=64)
    pids = [client._process.pid]
    try:
        async def main():
            pids.extend(deployment_pids(await client.health()))
            got = await client.generate(prompts, max_new_tokens=4, ignore_eos=True, prompt_logprobs=TOP, logprobs=1)
            plain = await client.generate(prompts, max_new_tokens=4, ignore_eos=True)
            chunks = [c async for c in client.stream(prompts[-1], max_new_tokens=3, ignore_eos=True,
                                                     prompt_logprobs=TOP)]
            return got, plain, chunks
        got, plain, chunks = asyncio.run(main())
    finally:
        client.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"
    for r, p, want, q in zip(got, plain, expected, prompts):
        _check(r.prompt_logprobs, want, q)
        assert r.token_ids == p.token_ids and len(r.logprobs) == 4 and p.prompt_logprobs is None
        assert r.usage.cached_tokens == 0
    _check(chunks[0].prompt_logprobs, expected[-1], prompts[-1])
    assert chunks[0].prompt_token_ids == prompts[-1]
    assert all(c.prompt_logprobs is None and c.prompt_token_ids is None for c in chunks[1:])


def test_prompt_logprobs_in_the_local_pipeline(model_dir, prompts, expected):
    """The in-process pipeline gives the same prompt logprobs, in its Responses and its stream's first chunk."""
    with mii_async.pipeline(str(model_dir), num_blocks=64) as pipe:
        got = pipe(prompts, max_new_tokens=2, ignore_eos=True, prompt_logprobs=TOP)

        async def stream():
            return [c async for c in pipe.stream(prompts[2], max_new_tokens=3, ignore_eos=True,
                                                 prompt_logprobs=TOP)]
        chunks = asyncio.run(stream())
    for r, want, q in zip(got, expected, prompts):
        _check(r.prompt_logprobs, want, q)
    _check(chunks[0].prompt_logprobs, expected[2], prompts[2])
    assert chunks[0].prompt_token_ids == prompts[2] and all(c.prompt_logprobs is None for c in chunks[1:])


def test_request_state_keeps_logprobs_only_for_a_response(model_dir, prompts):
    """RequestState hands the prompt's and the tokens' logprobs out in their chunks; by default (the router's,
    which only streams) it keeps none of them and leaves the prompt's packed, for its owner to take and forward
    as they came; with decode_prompt_logprobs (the pipeline's stream) the chunk has them as Logprobs, and with
    keep_logprobs (the pipeline's generate) they are also gathered for response()."""
    from types import SimpleNamespace as NS

    from transformers import AutoTokenizer

    from mii_async.outputs import Logprob
    from mii_async.params import SamplingParams
    from mii_async.text.request_state import RequestState
    from tests.packed_logprobs import pack

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = prompts[2]
    params = SamplingParams.from_kwargs(max_new_tokens=2, logprobs=1, prompt_logprobs=1)
    plps = pack([(-1.0 - i, [(7, -0.5)]) for i in range(1, len(prompt))], 1)
    want = [None] + [Logprob(t, -1.0 - i, [(7, -0.5)], 2) for i, t in enumerate(prompt[1:], 1)]
    events = [NS(token_id=5, logprobs=Logprob(5, -0.25, [(5, -0.25)], 1), finish_reason=None,
                 cached_tokens=0, prompt_logprobs=plps),
              NS(token_id=6, logprobs=Logprob(6, -0.5, [(6, -0.5)], 3), finish_reason="length",
                 cached_tokens=0, prompt_logprobs=plps)]   # (a second copy is ignored: it belongs to the first chunk)
    for mode in ({}, {"decode_prompt_logprobs": True}, {"keep_logprobs": True}):
        state = RequestState(tok, None, list(prompt), params, **mode)
        chunks, packed = [], []
        for ev in events:
            chunks.append(state.on_event(ev))
            packed.append(state.packed_prompt_logprobs)
            state.packed_prompt_logprobs = None          # as the router takes them
        assert [(c.logprobs[0].logprob, c.logprobs[0].rank) for c in chunks] == [(-0.25, 1), (-0.5, 3)]
        assert chunks[1].prompt_logprobs is None
        # the tokenizer is here: every Logprob, and every chunk that has any, knows the texts of the ids named
        assert [c.logprobs[0].text for c in chunks] == [tok.decode([5]), tok.decode([6])]
        assert chunks[0].token_texts.text(prompt[0]) == tok.decode([prompt[0]])   # the first has no Logprob
        if mode:
            assert chunks[0].prompt_logprobs == want and packed == [None, None]
            assert chunks[0].prompt_logprobs[1].top_texts == [tok.decode([7])]
        else:
            assert chunks[0].prompt_logprobs is None and packed == [plps, None]
        if "keep_logprobs" in mode:
            r = state.response()
            assert r.prompt_logprobs == want and [lp.token_id for lp in r.logprobs] == [5, 6]
        else:
            assert state.prompt_logprobs is None and state.logprobs is None, "the state holds logprobs"
