"""`--baseline hf`: transformers `generate` on the same requests, in the same run, on this machine.

Static batching is what `generate` offers: requests are sorted by output then input length (so a batch wastes
little on padding and on rows that finished early), left-padded into batches of `batch_size`, and each batch
generates greedily exactly its longest output length. Only the tokens each request asked for are counted, so
the work a static batch wastes shows as lower throughput, which is its real cost. Arrival times are ignored:
the baseline runs offline, at its best. Model load and one warm-up batch are excluded.
"""
from __future__ import annotations

import time
from typing import Any

from .workload import BenchRequest


def run_hf(model_dir: str, requests: list[BenchRequest], *, device: str = "auto", dtype: str = "auto",
           batch_size: int = 32) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    # The engine's own rule for "auto", so both sides run the same precision.
    torch_dtype = getattr(torch, dtype) if dtype != "auto" else (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(dev).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    ids = [r.prompt if isinstance(r.prompt, list) else tok(r.prompt).input_ids for r in requests]
    order = sorted(range(len(requests)), key=lambda i: (requests[i].output_len, len(ids[i])))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def run(batch: list[int]) -> None:
        width = max(len(ids[i]) for i in batch)
        x = torch.full((len(batch), width), pad, dtype=torch.long)          # [B, width], left-padded
        mask = torch.zeros_like(x)
        for row, i in enumerate(batch):
            x[row, width - len(ids[i]):] = torch.tensor(ids[i])
            mask[row, width - len(ids[i]):] = 1
        n = max(requests[i].output_len for i in batch)
        with torch.inference_mode():
            out = model.generate(x.to(dev), attention_mask=mask.to(dev), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad)
        assert out.shape[1] - width == n, f"HF generated {out.shape[1] - width} tokens, expected {n}"

    run(batches[0][:1])                                                        # warm-up
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for b in batches:
        run(b)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    out_tokens = sum(r.output_len for r in requests)
    return {"system": "HF transformers generate, static batches", "batch_size": batch_size, "device": str(dev),
            "dtype": str(torch_dtype).removeprefix("torch."), "seconds": seconds, "output_tokens": out_tokens,
            "output_throughput": out_tokens / seconds, "request_throughput": len(requests) / seconds}
