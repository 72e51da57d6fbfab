"""Prompt encoding that no prompt can stall: a text that cannot fit the context is refused before it is
tokenized, and long prompts being tokenized do not hold back a short request (router/encoder_pool.py)."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

import mii_async


def _words(n_chars: int, seed: int) -> str:
    rnd = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "omicron"]
    out, size = [], 0
    while size < n_chars:
        w = rnd.choice(words) + str(rnd.randrange(1000))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(deployment):
    """8 MB of text against an 8k context: refused naming `prompt`, without the seconds tokenizing it takes
    (the refusal says why: characters, not tokens)."""
    with pytest.raises(mii_async.RequestTooLongError) as e:
        deployment.run(deployment.generate(["x" * (8 << 20)], max_new_tokens=1))
    assert e.value.param == "prompt" and "characters" in str(e.value)


def test_long_prompts_being_tokenized_do_not_hold_back_a_short_one(deployment):
    """Eight long prompts (under the character bound: each is tokenized, for up to seconds, then refused for
    its token count) sent at once, then a short request: the short one is answered before the long ones are
    all refused. Encoded in arrival order on one thread, it would come last: it waits for no long prompt's
    tokenizing, only for its own two tokens (on a loaded machine those may take a while: no clock is
    asserted)."""
    limits = deployment.run(deployment.health())["limits"]
    context = min(limits["max_model_len"], limits["max_request_tokens"])
    long_text = _words(min(1_900_000, 200 * context), 0)
    order: list[str] = []

    async def long(i: int) -> None:
        with pytest.raises(mii_async.RequestTooLongError):
            await deployment.generate([long_text + f" {i}"], max_new_tokens=1)
        order.append(f"long{i}")

    async def short() -> None:
        [r] = await deployment.generate(["Hi"], max_new_tokens=2)
        assert r.generated_text is not None
        order.append("short")

    async def main() -> None:
        longs = [asyncio.create_task(long(i)) for i in range(8)]
        await asyncio.sleep(0.5)                     # the long ones are queued or being tokenized
        t0 = time.monotonic()
        await asyncio.wait_for(short(), 120)
        short_s = time.monotonic() - t0
        await asyncio.wait_for(asyncio.gather(*longs), 600)
        print(f"short request beside 8 long prompts: {short_s:.2f} s; answered {order.index('short') + 1}th")

    deployment.run(main())
    assert order[-1] != "short" and len(order) == 9, order
