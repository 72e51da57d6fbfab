"""The sampler against transformers' logits processors, and its seeded draws against the distribution."""
from __future__ import annotations

import pytest
import torch

from mii_async.params import SamplingParams
from mii_async.workers.sampling.sampler import Sampler
from mii_async.workers.core.sequence import Sequence


def _seq(i, **params):
    return Sequence(i, [5, 6, 7, 5], SamplingParams(**params), output_ids=[7, 9, 9])


def _guided(seq):
    """`seq` with its guide, over a 50-token vocabulary of letters (id 2 is the end id)."""
    if seq.params.guided_regex is not None:
        from outlines_core import Index, Vocabulary

        from mii_async.workers.sampling.guides import RequestGuide

        vocab = Vocabulary(2, {bytes([97 + j % 26]) * (1 + j // 26): [j] for j in range(50) if j != 2})
        seq.guide = RequestGuide(Index(seq.params.guided_regex, vocab), 1)
    return seq


@pytest.mark.parametrize("params", [dict(top_k=5), dict(top_p=0.7), dict(min_p=0.2), dict(top_k=8, top_p=0.5),
                                    dict(temperature=0.5, top_p=0.9)])
def test_filters_match_transformers(params):
    """The tokens top-k / top-p / min-p keep are the ones transformers' warpers keep."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(3, 50) * 3
    p = {"temperature": 1.0, **params}
    probs = Sampler._filtered_probs(logits.clone(), [_seq(i, **p) for i in range(3)])
    ref = TemperatureLogitsWarper(p["temperature"])(None, logits.clone())
    if "top_k" in p:
        ref = TopKLogitsWarper(p["top_k"])(None, ref)
    if "top_p" in p:
        ref = TopPLogitsWarper(p["top_p"])(None, ref)
    if "min_p" in p:
        ref = MinPLogitsWarper(p["min_p"])(None, ref)
    assert torch.equal(probs > 0, torch.isfinite(ref))
    assert torch.allclose(probs, torch.softmax(ref, -1), atol=1e-6)


def test_repetition_penalty_follows_a_growing_output_with_the_prompt_put_up_once():
    """Step after step, the repetition penalty equals transformers' over prompt + output so far (ids in both
    included); the prompt's ids go to the device once, at the first step, not at every step."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    s = Sampler(30, frozenset({2}), torch.device("cpu"))
    seq = Sequence(0, [5, 6, 7, 5, 11], SamplingParams(repetition_penalty=1.7))
    first = None
    for tok in [None, 7, 20, 20, 3]:
        if tok is not None:
            seq.output_ids.append(tok)
        logits = torch.randn(1, 30)
        out = logits.clone()
        s._penalize(out, [seq])
        ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seq.prompt_ids + seq.output_ids]), logits.clone())
        assert torch.allclose(out, ref)
        first = first if first is not None else seq.penalty_prompt
        assert seq.penalty_prompt is first and first.tolist() == [5, 6, 7, 11]


def test_penalties_match_definitions():
    """Repetition penalty equals transformers' processor; presence/frequency follow OpenAI's formula."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 20)
    s = Sampler(20, frozenset({2}), torch.device("cpu"))
    out = logits.clone()
    s._penalize(out, [_seq(0, repetition_penalty=1.3)])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[5, 6, 7, 5, 7, 9, 9]]), logits.clone())
    assert torch.allclose(out, ref)
    out = logits.clone()
    s._penalize(out, [_seq(0, presence_penalty=0.5, frequency_penalty=0.25)])
    expected = logits.clone()
    expected[0, 7] -= 0.25 + 0.5
    expected[0, 9] -= 0.5 + 0.5
    assert torch.allclose(out, expected)


def test_min_new_tokens_masks_end_ids():
    """Before min_new_tokens, EOS and stop_token_ids cannot be chosen even when they are the argmax."""
    s = Sampler(10, frozenset({2}), torch.device("cpu"))
    logits = torch.zeros(1, 10)
    logits[0, 2], logits[0, 4], logits[0, 1] = 10.0, 9.0, 8.0
    assert s(logits, [_seq(0, min_new_tokens=5, stop_token_ids=(4,))]).token_ids == [1]
    assert s(logits, [_seq(0)]).token_ids == [2]


def test_logit_bias_is_added_before_the_choice():
    """logit_bias adds to the logits after the penalties: +100 makes a token the greedy choice, −100 bans the
    argmax; a sampled row with a banned token never draws it; rows without a bias are untouched."""
    s = Sampler(10, frozenset({2}), torch.device("cpu"))
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0
    rows = [_seq(0, logit_bias={8: 100.0}), _seq(1), _seq(2, logit_bias={"4": -100})]
    assert s(logits, rows).token_ids == [8, 4, 0]
    out = logits.clone()
    s._penalize(out, [_seq(0, logit_bias={3: 1.5, 9: -2.0}), _seq(1), _seq(2, repetition_penalty=2.0,
                                                                        logit_bias={7: 1.0})])
    expected = logits.clone()
    expected[0, 3] += 1.5
    expected[0, 9] -= 2.0
    expected[2, 7] = 1.0        # token 7 is in the history: penalized first (0 stays 0), then biased (+1);
                                # biased first, it would be (0 + 1) / 2
    assert torch.equal(out, expected), out
    draws = {s(logits[:1], [_seq(i, temperature=1.0, seed=i, logit_bias={4: -100})]).token_ids[0] for i in range(200)}
    assert 4 not in draws and len(draws) > 3


def test_logprobs_carry_the_chosen_tokens_rank():
    """A sampled row's logprobs carry its token's rank among the row's logprobs: tokens at least as likely, the
    token included (vLLM's count), over the raw logits (a logit bias changes the choice, not the ranks). Greedy
    picks rank 1, or the size of a tie at the top; a seeded draw at a high temperature ranks by the definition."""
    logits = torch.randn(4, 50).clamp(-3, 3) * 2         # under 7: nothing outranks the tie below
    logits[1, :10] = 7.0                                  # a ten-way tie at the top
    s = Sampler(50, frozenset({2}), torch.device("cpu"))
    seqs = [_seq(0, logprobs=2), _seq(1, logprobs=0), _seq(2, temperature=5.0, seed=3, logprobs=1),
            _seq(3, temperature=5.0, seed=4, logprobs=3, logit_bias={11: -100.0})]
    out = s(logits.clone(), seqs)
    lp = torch.log_softmax(logits, -1)
    for i, (tok, got) in enumerate(zip(out.token_ids, out.logprobs)):
        assert got.rank == int((lp[i] >= lp[i, tok]).sum()), (i, tok)
    assert out.logprobs[0].rank == 1
    assert out.logprobs[1].rank == 10 and out.token_ids[1] < 10          # the tie's first, ranked after all ten
    assert 1 <= out.logprobs[2].rank <= 50 and out.token_ids[3] != 11


def test_seeded_draws_follow_the_distribution():
    """Seeded sampling reproduces per seed and its frequencies match the probabilities."""
    s = Sampler(4, frozenset(), torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    draws = [s(logits, [_seq(i, temperature=1.0, seed=i)]).token_ids[0] for i in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03)
    s2 = Sampler(4, frozenset(), torch.device("cpu"))
    assert [s2(logits, [_seq(i, temperature=1.0, seed=i)]).token_ids[0] for i in range(50)] == draws[:50]


@pytest.mark.gpu
def test_launch_never_waits_on_the_device():
    """On CUDA, `launch` for every kind of row (filters, seeds, penalties, logit bias, guides, min_new_tokens,
    logprobs) makes no synchronizing call (torch's sync debug mode raises on one), so async scheduling overlaps sampled
    steps; the same rows on the CPU give the same tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kinds = [dict(), dict(temperature=0.8, top_k=5, top_p=0.9, seed=3), dict(temperature=1.0, min_p=0.1),
             dict(temperature=0.7, top_k=0), dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
             dict(min_new_tokens=8), dict(logprobs=3), dict(temperature=0.9, seed=11, logprobs=2),
             dict(logit_bias={7: 5.0, 9: -100.0}), dict(temperature=0.6, seed=5, logit_bias={1: 3.0}),
             dict(guided_regex="[a-c]+"), dict(guided_regex="[a-c]+", temperature=1.0, seed=2, logprobs=2)]
    logits = torch.randn(len(kinds), 50) * 3
    results = []
    for device in ("cpu", "cuda"):
        sampler = Sampler(50, frozenset({2}), torch.device(device))
        seqs = [_guided(_seq(i, **k)) for i, k in enumerate(kinds)]
        lg = logits.to(device)
        torch.cuda.synchronize()
        if device == "cuda":                  # each kind alone first, so that a failure names it
            for i, k in enumerate(kinds):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    sampler.launch(lg[i:i + 1], [_guided(_seq(100 + i, **k))])
                except RuntimeError as exc:
                    raise AssertionError(f"launch of {k} synchronizes: {exc}") from exc
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.set_sync_debug_mode("error")
        try:
            pending = sampler.launch(lg, seqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append(sampler.resolve(pending))
    cpu, gpu = results
    greedy = [i for i, k in enumerate(kinds) if not k.get("temperature")]
    assert [cpu.token_ids[i] for i in greedy] == [gpu.token_ids[i] for i in greedy]
    assert all(t is not None for t in gpu.token_ids)
    assert gpu.logprobs[6] is not None and len(gpu.logprobs[6].top) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("params", [dict(), dict(logprobs=2)])
def test_resolve_waits_only_for_its_own_step(params):
    """`resolve` reads a step's ids behind that step's own event: work queued on the stream after the launch
    (under async scheduling, the next step) does not delay it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sampler = Sampler(50, frozenset({2}), torch.device("cuda"))
    logits = torch.randn(4, 50, device="cuda")
    want = torch.argmax(logits, -1).tolist()
    pending = sampler.launch(logits, [_seq(i, **params) for i in range(4)])
    torch.cuda.synchronize()
    t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pending = sampler.launch(logits, [_seq(i, **params) for i in range(4)])
    t[0].record()
    torch.cuda._sleep(int(2e9))              # about a second of device time, queued behind the step
    t[1].record()
    import time
    t0 = time.perf_counter()
    result = sampler.resolve(pending)
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert t[0].elapsed_time(t[1]) > 200, "the sleep kernel did not hold the stream"
    assert waited < 0.1, f"resolve waited {waited:.3f} s: it waited for work queued after its step"
    assert result.token_ids == want
    if params:
        assert all(lp is not None and len(lp.top) == 2 for lp in result.logprobs)
