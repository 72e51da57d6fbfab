"""What a serving benchmark sends: a list of requests (prompt, its length in tokens, the output length asked).

Three sources, as in vLLM's `bench serve`:
- random: seeded random token ids, input and output lengths uniform in given ranges, an optional shared prefix
  (the same ids at the head of every prompt, so the prefix cache has something to do);
- sharegpt: a ShareGPT-format JSON file; each conversation's first human turn is the prompt and the length of
  the reply that follows, in tokens, is the output length (conversations outside the length limits are left out,
  with vLLM's limits by default);
- prompts: a text file with one prompt per line, or JSON lines of {"prompt": ..., "output_len": ...}.

Prompts of the random workload are token ids, sent as ids, so their length is exact; the others are text.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from ..errors import InvalidParameterError


class BenchRequest(NamedTuple):
    prompt: str | list[int]     # text, or token ids sent as ids
    prompt_len: int             # tokens, by the model's tokenizer
    output_len: int             # new tokens asked (exactly this many with ignore_eos)


def _range(param: str, lo: int, hi: int, minimum: int) -> None:
    if lo < minimum or hi < lo:
        raise InvalidParameterError(param, f"needs {minimum} <= MIN <= MAX, got {lo} {hi}")


def random_requests(n: int, input_len: tuple[int, int], output_len: tuple[int, int], *, prefix_len: int = 0,
                    seed: int = 0, vocab_size: int, special_ids: Sequence[int] = ()) -> list[BenchRequest]:
    """`n` prompts of random ids drawn from the vocabulary less its special ids; `input_len` counts the shared
    prefix, so every prompt is at least `prefix_len + 1` tokens long."""
    if n < 1:
        raise InvalidParameterError("num_prompts", f"must be at least 1, got {n}")
    _range("input_len", *input_len, minimum=1)
    _range("output_len", *output_len, minimum=1)
    if prefix_len < 0 or prefix_len >= input_len[0]:
        raise InvalidParameterError("prefix_len", f"must be in [0, the smallest input length {input_len[0]}), "
                                    f"got {prefix_len}")
    special = set(special_ids)
    pool = [t for t in range(vocab_size) if t not in special]
    if not pool:
        raise InvalidParameterError("tokenizer", "its vocabulary has no ordinary tokens to draw prompts from")
    rng = random.Random(seed)
    prefix = [rng.choice(pool) for _ in range(prefix_len)]
    out = []
    for _ in range(n):
        length = rng.randint(*input_len)
        ids = prefix + [rng.choice(pool) for _ in range(length - prefix_len)]
        out.append(BenchRequest(ids, length, rng.randint(*output_len)))
    return out


def sharegpt_requests(path: str, n: int, tokenizer: Any, *, seed: int = 0, output_len: int | None = None,
                      max_input_len: int = 1024, max_total_len: int = 2048) -> list[BenchRequest]:
    """`n` conversations sampled (seeded) from a ShareGPT JSON file: a list of {"conversations": [{"from",
    "value"}, ...]}. Too-short (< 4 tokens) or too-long ones are skipped; `output_len` overrides the reply's."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidParameterError("dataset_path", f"cannot read {path} as JSON: {exc}") from None
    if not isinstance(data, list):
        raise InvalidParameterError("dataset_path", f"{path} is not a ShareGPT file (a JSON list of conversations)")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) and isinstance(t.get("value"), str)
                                                              for t in turns[:2]):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) == n:
            break
        p_len = len(tokenizer(prompt).input_ids)
        o_len = output_len or len(tokenizer(reply).input_ids)
        if p_len < 4 or o_len < 4 or p_len > max_input_len or p_len + o_len > max_total_len:
            continue
        out.append(BenchRequest(prompt, p_len, o_len))
    if not out:
        raise InvalidParameterError("dataset_path", f"{path} has no conversation within the length limits "
                                    f"(prompt 4..{max_input_len} tokens, total <= {max_total_len})")
    return out


def prompts_file_requests(path: str, n: int | None, tokenizer: Any, output_len: int) -> list[BenchRequest]:
    """Prompts from a text file (one per line) or JSON lines ({"prompt", optional "output_len"}), in order."""
    if output_len < 1:
        raise InvalidParameterError("output_len", f"must be at least 1, got {output_len}")
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as exc:
        raise InvalidParameterError("dataset_path", f"cannot read {path}: {exc}") from None
    out = []
    for i, line in enumerate(lines[:n] if n else lines):
        prompt, o_len = line, output_len
        if path.endswith(".jsonl"):
            try:
                obj = json.loads(line)
                prompt, o_len = obj["prompt"], int(obj.get("output_len", output_len))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidParameterError("dataset_path", f"{path} line {i + 1}: {exc!r}") from None
        out.append(BenchRequest(prompt, len(tokenizer(prompt).input_ids), o_len))
    if not out:
        raise InvalidParameterError("dataset_path", f"{path} holds no prompt")
    return out
