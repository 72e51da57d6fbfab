"""Prefill-heavy loads on an in-process engine (python -m benchmarks.llama8b --shape llama3.1-8b --only
long,long1,longparity): many 4k–8k-token prompts at once, one 32k-token prompt, and greedy agreement with
transformers at long contexts.

Floors: a token's FLOPs are two per weight it multiplies (model_shapes.token_flops) plus its attention's, 4 · L ·
c · Hq · D for a query at context c (QKᵀ and PV, two FLOPs a multiply-add each); over the card's bf16 matmul rate.
The figure without attention is the one the issue tracker quotes (16 GFLOP a token on the 8B shape).
"""
from __future__ import annotations

import statistics

import torch

import mii_async

from .engine_drain import drain
from .token_prompts import prompts


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def attention_flops(cfg, start: int, n: int) -> float:
    """FLOPs of the attention of queries at positions start … start + n - 1 over their causal contexts."""
    hq, d = cfg.num_attention_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    contexts = n * start + n * (n + 1) / 2                  # Σ (position + 1)
    return 4.0 * cfg.num_hidden_layers * hq * d * contexts


def kv_token_bytes(cfg, element_size: int) -> int:
    """Bytes of K and V one token keeps in the cache, over every layer, at `element_size` bytes an element."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * element_size


def decode_kv_bytes(prompt_lens: list[int], out: int, token_bytes: int) -> int:
    """The K/V bytes a load's decode steps read: a sequence's output token j (from 1 on; token 0 comes with
    its prefill) is decoded over its prompt and j earlier outputs, and attention reads all of them."""
    return token_bytes * sum((out - 1) * p + (out - 1) * out // 2 for p in prompt_lens)


def long_load(engine, cfg, token_flops: float, flops_rate: float, bandwidth: float, token_bytes: int,
              n: int = 64, lo: int = 4000, hi: int = 7900, out: int = 256) -> dict:
    """n requests of lo–hi prompt tokens and `out` output tokens, all at once: total and output tokens/s, TTFT
    and ITL percentiles, and the floors of the whole load: its FLOPs over `flops_rate` (with and without
    attention), and with the decodes' K/V reads (`token_bytes` a cached token) over `bandwidth` added, which
    the FLOP floor leaves out."""
    ps = prompts(n, lo, hi, 8)
    engine.reset_prefix_cache()
    drain(engine, [(p, 4) for p in ps[:2]], 60_000)            # warm-up: the long-prompt step shapes
    engine.reset_prefix_cache()
    before = engine.stats()
    secs, times = drain(engine, [(p, out) for p in ps], 61_000)
    after = engine.stats()
    prompt_tokens, out_tokens = sum(len(p) for p in ps), sum(len(t) for t in times.values())
    ttft = [t[0] for t in times.values() if t]
    itl = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    weights = token_flops * (prompt_tokens + out_tokens)
    attn = sum(attention_flops(cfg, 0, len(p) + out) for p in ps)
    floor_s, floor_attn_s = weights / flops_rate, (weights + attn) / flops_rate
    kv_s = decode_kv_bytes([len(p) for p in ps], out, token_bytes) / bandwidth
    return {"requests": n, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens, "seconds": secs,
            "total_tok_s": (prompt_tokens + out_tokens) / secs, "output_tok_s": out_tokens / secs,
            "ttft_s_p50": _pct(ttft, 0.5), "ttft_s_p99": _pct(ttft, 0.99),
            "itl_ms_p50": 1e3 * _pct(itl, 0.5), "itl_ms_p99": 1e3 * _pct(itl, 0.99),
            "floor_total_tok_s": (prompt_tokens + out_tokens) / floor_s,
            "floor_total_tok_s_with_attention": (prompt_tokens + out_tokens) / floor_attn_s,
            "share_of_floor": floor_s / secs, "share_of_floor_with_attention": floor_attn_s / secs,
            "decode_kv_read_s": kv_s, "share_of_floor_with_attention_and_kv": (floor_attn_s + kv_s) / secs,
            "preemptions": after.get("preemptions", 0) - before.get("preemptions", 0)}


def long_one(engine, cfg, token_flops: float, flops_rate: float, length: int = 32_000, new: int = 128) -> dict:
    """One prompt of `length` tokens: its TTFT against the FLOP floor of its prefill (attention included), and
    the decode step at that context against the batch-1 step after 128 tokens."""
    p = prompts(1, length, length, 9)[0]
    short = prompts(1, 128, 128, 3)[0]
    engine.reset_prefix_cache()
    drain(engine, [(short, 8)], 70_000)                      # warm-up
    _, t_short = drain(engine, [(short, new + 1)], 71_000)
    engine.reset_prefix_cache()
    _, t_long = drain(engine, [(p, new + 1)], 72_000)
    short_step = statistics.median(b - a for a, b in zip(t_short[71_000][1:], t_short[71_000][2:]))
    long_step = statistics.median(b - a for a, b in zip(t_long[72_000][1:], t_long[72_000][2:]))
    ttft = t_long[72_000][0]
    floor = (token_flops * length + attention_flops(cfg, 0, length)) / flops_rate
    return {"prompt_tokens": length, "ttft_s": ttft, "ttft_floor_s": floor, "ttft_over_floor": ttft / floor,
            "decode_ms_at_context": 1e3 * long_step, "decode_ms_at_128": 1e3 * short_step,
            "decode_ratio": long_step / short_step}


def long_parity(engine, hf, lengths: tuple[int, ...] = (8_000, 32_000), new: int = 32,
                ids: tuple[int, int] = (1000, 128000)) -> dict:
    """Per prompt length: our greedy tokens against transformers' `generate` on the same weights (tokens
    before the first difference), and the last prompt position's logits against transformers' (relative error,
    transformers' forward computing that position's logits only). Prompts draw token ids from `ids`."""
    out = {}
    for n in lengths:
        p = prompts(1, n, n, 10 + n, ids)[0]
        engine.reset_prefix_cache()
        engine.add_request(80_000 + n, p, mii_async.SamplingParams(max_new_tokens=1, ignore_eos=True))
        seq = engine.seqs[80_000 + n]
        logits = None
        while seq.num_computed_tokens < len(p):              # the prompt's chunks, the last one sampled
            plan = engine.scheduler.schedule()
            lg = engine.runner.execute(plan)
            engine.scheduler.commit(seq, len(plan.seqs[0].token_ids))
            if plan.seqs[0].sample:
                logits = lg[0].float()
        engine.abort(80_000 + n)
        x = torch.tensor([p], device=hf.device)
        with torch.no_grad():
            ref = hf(x, logits_to_keep=1).logits[0, -1].float()
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)[0, n:].tolist()
        ours = _tokens(engine, p, new)
        first = next((i for i, (a, b) in enumerate(zip(ours, gen)) if a != b), new)
        logits = logits.to(ref.device)
        out[str(n)] = {"logits_rel_err": float(torch.linalg.norm(logits - ref) / torch.linalg.norm(ref)),
                       "greedy_tokens_before_divergence": first, "of": new}
    return out


def _tokens(engine, prompt: list[int], new: int) -> list[int]:
    """Our greedy continuation of `prompt`."""
    rid = 90_000 + len(prompt)
    engine.add_request(rid, prompt, mii_async.SamplingParams(max_new_tokens=new, ignore_eos=True))
    toks: list[int] = []
    while engine.has_work():
        toks += [o.token_id for o in engine.step() if o.req_id == rid]
    return toks
