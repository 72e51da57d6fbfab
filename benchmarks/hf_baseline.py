"""transformers' side of benchmarks/llama8b.py, run before our engine is built so that a shape whose two copies
would not fit the card (a 30B mixture of experts on an 80 GB one) can hand its weights over: the references of
the parity check, and `generate`'s batch-1 and offline figures.

The parity references are transformers' forward in fp32 (in bf16 where an fp32 copy would not fit beside the
model), and transformers' own bf16 beside it: random multi-layer models amplify rounding (near-flat logits make
greedy choices fragile), so bf16's own distance from fp32 is the yardstick. With FP8 projections, also the fp32
forward with each projection's weight replaced by its FP8 rounding (per output channel, as the engine quantizes
at load; activations exact): the error the weights' rounding alone brings; and that forward with each
projection's input also rounded as the engine quantizes it (e4m3, a scale per token): the FP8 model itself in
fp32, against which our FP8 kernels' own error shows.
"""
from __future__ import annotations

import copy
import time
from typing import Any

import torch

from .token_prompts import prompts

PARITY_PROMPTS, GREEDY_PROMPTS, GREEDY_NEW = 4, 32, 64


def _greedy(model: Any, ids: torch.Tensor, new: int) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def _references(model: Any, ps: list[list[int]], greedy_ids: torch.Tensor, nxt: list[int] | None = None) -> dict:
    """For each parity prompt: the last position's logits, its argmax, and the logits one token later (after
    `nxt`'s token for it where given, else that argmax: every reference is then over the same tokens); and
    greedy continuations of the greedy prompts. Kept on the CPU."""
    last, toks, after = [], [], []
    for i, p in enumerate(ps):
        with torch.no_grad():
            lg = model(torch.tensor([p], device="cuda")).logits[0, -1].float()
            tok = int(lg.argmax()) if nxt is None else nxt[i]
            lg2 = model(torch.tensor([p + [tok]], device="cuda")).logits[0, -1].float()
        last.append(lg.cpu())
        toks.append(tok)
        after.append(lg2.cpu())
    return {"last": last, "next": toks, "after": after, "greedy": _greedy(model, greedy_ids, GREEDY_NEW)}


def fp8_rounded_(model: Any) -> None:
    """Each decoder projection's weight (not the embedding or the LM head, which the engine keeps in the model
    dtype) replaced in place by its per-output-channel e4m3 rounding, dequantized."""
    from mii_async.kernels.fp8_weight import quantize_weight

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}" and "lm_head" not in name:
            q = quantize_weight(mod.weight.data)
            mod.weight.data.copy_(q.dequantize(torch.float32).to(mod.weight.dtype))


def fp8_inputs_(model: Any) -> None:
    """Each decoder projection's input rounded as the engine's FP8 GEMMs quantize it: e4m3 with a scale per
    token (kernels/fp8_weight.py's quantize_activations), dequantized."""
    from mii_async.kernels.fp8_weight import quantize_activations

    def hook(_mod: Any, args: tuple) -> tuple:
        x = args[0]
        q, scale = quantize_activations(x.reshape(-1, x.shape[-1]))
        return ((q.float() * scale[:, None]).view(x.shape).to(x.dtype), *args[1:])

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}" and "lm_head" not in name:
            mod.register_forward_pre_hook(hook)


def parity_references(hf: Any, fp32: bool = True, fp8_weights: bool = False) -> dict:
    """References from transformers' bf16 model and, where `fp32`, an fp32 copy of it (and with `fp8_weights`
    that copy over FP8-rounded projections): see the module's docstring."""
    ps = prompts(PARITY_PROMPTS, 128, 128, 1)
    greedy_ids = torch.tensor(prompts(GREEDY_PROMPTS, 128, 128, 2), device="cuda")
    refs: dict = {"prompts": ps, "greedy_prompts": greedy_ids.tolist()}
    if fp32:                            # the main reference first: the others follow its tokens
        hf32 = copy.deepcopy(hf).float()
        refs["fp32"] = _references(hf32, ps, greedy_ids)
        if fp8_weights:
            fp8_rounded_(hf32)
            refs["fp32_fp8_weights"] = _references(hf32, ps, greedy_ids, refs["fp32"]["next"])
            fp8_inputs_(hf32)
            refs["fp32_fp8"] = _references(hf32, ps, greedy_ids, refs["fp32"]["next"])
        del hf32
        torch.cuda.empty_cache()
    refs["bf16"] = _references(hf, ps, greedy_ids, refs["fp32"]["next"] if fp32 else None)
    return refs


def _timed_generate(hf: Any, ids: torch.Tensor, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_bs1(hf: Any, new: int = 128) -> float:
    """transformers `generate`'s ms per decode step at batch 1 after a 128-token prompt (the prefill's time taken
    out: a 1-token generate subtracted)."""
    ids = torch.tensor([prompts(1, 128, 128, 3)[0]], device="cuda")
    _timed_generate(hf, ids, 4)
    return 1e3 * (_timed_generate(hf, ids, new + 1) - _timed_generate(hf, ids, 1)) / new


def hf_offline(hf: Any, batches: list[int]) -> dict[int, float]:
    """transformers `generate`'s output tokens/s on the offline load's first prompts (128 in / 128 out), all of
    one batch at once, for each batch size. A batch that does not fit the card is reported and left out (the
    best of the others is the baseline); if none fits, the run stops there."""
    ps = prompts(max(batches), 128, 128, 4)
    out = {}
    for b in batches:
        ids = torch.tensor(ps[:b], device="cuda")
        _timed_generate(hf, ids[:2], 2)
        try:
            out[b] = b * 128 / _timed_generate(hf, ids, 128)
        except torch.OutOfMemoryError:
            print(f"transformers generate at batch {b}: out of GPU memory, left out of the baseline", flush=True)
            torch.cuda.empty_cache()
    if not out:
        raise SystemExit(f"transformers generate ran out of GPU memory at every batch of {batches}")
    return out
