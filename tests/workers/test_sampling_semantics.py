"""Sampling semantics that vLLM and transformers users rely on: top-p's boundary, a row's distribution not
depending on its batch, and logprobs of the raw logits (vLLM's default `raw_logprobs`)."""
from __future__ import annotations

import pytest
import torch

from mii_async.params import SamplingParams
from mii_async.workers.sampling.sampler import Sampler
from mii_async.workers.core.sequence import Sequence


def _seq(i, **params):
    return Sequence(i, [5, 6, 7, 5], SamplingParams(**params), output_ids=[7, 9, 9])


@pytest.mark.parametrize("top_p,kept", [(0.5, 4), (0.25, 2), (0.75, 6), (0.3, 3), (1e-9, 1), (1.0, 8)])
def test_top_p_keeps_the_smallest_set_that_reaches_the_mass(top_p, kept):
    """Eight equally likely tokens: top_p keeps the fewest whose mass reaches top_p (0.5 → 4, not 5), as
    transformers' TopPLogitsWarper and vLLM do; the most likely token always stays."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.zeros(1, 8)
    probs = Sampler._filtered_probs(logits.clone(), [_seq(0, temperature=1.0, top_p=top_p)])
    ref = TopPLogitsWarper(top_p)(None, logits.clone())
    assert int((probs > 0).sum()) == int(torch.isfinite(ref).sum()) == kept


def test_a_rows_distribution_does_not_depend_on_its_batch():
    """A row's filtered probabilities are bit-identical alone and beside rows with top-p, top-k and min-p
    (a row without top-p used to lose its tail to cumsum rounding past 1.0), so its seeded draws are too."""
    torch.manual_seed(0)
    logits = torch.randn(4, 4096) * 2
    mine = dict(temperature=0.9)
    others = [dict(temperature=1.0, top_p=0.5), dict(temperature=0.7, top_k=20), dict(temperature=1.3, min_p=0.1)]
    for own in (mine, dict(temperature=0.9, top_p=0.95), dict(temperature=0.9, top_k=50, min_p=0.05)):
        alone = Sampler._filtered_probs(logits[:1].clone(), [_seq(0, **own)])
        batched = Sampler._filtered_probs(logits.clone(), [_seq(0, **own)] + [_seq(i + 1, **o) for i, o in enumerate(others)])
        assert torch.equal(alone[0], batched[0]), own
    for seed in range(20):
        a = Sampler(4096, frozenset(), torch.device("cpu"))([logits[:1].clone()][0], [_seq(0, seed=seed, **mine)])
        b = Sampler(4096, frozenset(), torch.device("cpu"))(
            logits.clone(), [_seq(0, seed=seed, **mine)] + [_seq(i + 1, **o) for i, o in enumerate(others)])
        assert a.token_ids[0] == b.token_ids[0]


def test_logprobs_are_of_the_raw_logits():
    """As vLLM's default (logprobs_mode raw_logprobs) and as prompt_logprobs here: the chosen token's logprob,
    its rank and the top n are the log-softmax of the model's logits, before penalties, logit_bias, the
    min_new_tokens mask, temperature and top-k/top-p; the choice itself still follows them all."""
    torch.manual_seed(1)
    logits = torch.randn(4, 50) * 2
    logits[:, 2] = 20.0                                   # the end id is every row's raw argmax
    s = Sampler(50, frozenset({2}), torch.device("cpu"))
    seqs = [_seq(0, logprobs=3, min_new_tokens=5),
            _seq(1, logprobs=2, logit_bias={11: 100.0}),
            _seq(2, logprobs=1, repetition_penalty=50.0, presence_penalty=2.0, logit_bias={2: -100.0}),
            _seq(3, logprobs=4, temperature=0.3, top_k=3, seed=5)]
    out = s(logits.clone(), seqs)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids[0] != 2 and out.token_ids[1] == 11 and out.token_ids[2] != 2
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.logprob == pytest.approx(float(raw[i, tok]), abs=1e-5), i
        assert lp.rank == int((raw[i] >= raw[i, tok]).sum()), i
        want = torch.topk(raw[i], seqs[i].params.logprobs)
        assert [t for t, _ in lp.top] == want.indices.tolist(), i
        assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=1e-5), i
    assert out.logprobs[0].top[0][0] == 2                 # masked for the choice, yet the raw favourite


def test_guided_rows_logprobs_keep_the_guide_mask():
    """A guide's mask is part of the logits the sampler is given (as vLLM applies its grammar bitmask before
    the sampler): a guided row's logprobs put tokens outside the guide at the floor, and a penalty still
    changes the choice but not the logprobs."""
    from outlines_core import Index, Vocabulary

    from mii_async.workers.sampling.guides import RequestGuide

    vocab = Vocabulary(2, {bytes([97 + j % 26]) * (1 + j // 26): [j] for j in range(50) if j != 2})
    seq = _seq(0, guided_regex="[a-c]+", logprobs=3, repetition_penalty=1.5)
    seq.guide = RequestGuide(Index("[a-c]+", vocab), 1)
    logits = torch.randn(1, 50)
    out = Sampler(50, frozenset({2}), torch.device("cpu"))(logits.clone(), [seq])
    lp = out.logprobs[0]
    assert all(t in (0, 1, 26, 27, 28, 52) or v == -9999.0 for t, v in lp.top)
    assert out.token_ids[0] in (0, 1, 26, 27, 28)
