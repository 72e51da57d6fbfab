"""The chat page when the conversation outgrows what the deployment takes (its context, or its KV pool), in
headless chromium against the session's gateway: the oldest turns stop being sent, as `mii-async chat` forgets
them, instead of every later message failing until New chat."""
from __future__ import annotations

import pytest

from tests.gateway.test_chat_page import MISSING, REQUIRE, browser, new_chat  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None and not REQUIRE, reason=f"no browser: {MISSING}")]


def test_forgets_the_oldest_turns_when_the_conversation_outgrows_the_context(new_chat, gateway_url, deployment):
    """Two long questions that fit one at a time but not together: the second is sent again without the first
    turn and is answered; a notice says so; the whole conversation stays on screen; the next question is sent
    with the history that fitted (the first turn stays forgotten)."""
    from playwright.sync_api import expect

    limits = deployment.run(deployment.health())["limits"]
    tokens = min(limits["max_model_len"], limits["max_request_tokens"]) * 3 // 5
    chat = new_chat(gateway_url)
    page = chat.page
    chat.open()
    chat.settings(temperature="0", max_tokens="8")
    first = "The quick brown fox jumps over the lazy dog. " * (tokens // 10) + "Who is lazy?"   # 10 tokens each
    second = "A cat sat on the mat. " * (tokens // 7) + "Where did it sit?"
    chat.ask(first)
    finish1, answer1 = chat.answer(0)
    assert finish1 in ("stop", "length"), answer1
    chat.ask(second)
    finish2, answer2 = chat.answer(1)
    assert finish2 in ("stop", "length"), answer2                 # answered: not an error

    sent = chat.generates()
    assert [len(f["messages"]) for f in sent] == [1, 3, 1], sent   # 3: refused as too long, then without turn 1
    assert sent[2]["messages"] == [{"role": "user", "content": second}]
    expect(page.locator("#messages .notice")).to_have_count(1)
    expect(page.locator("#messages .notice")).to_contain_text("context")
    expect(page.locator("#messages .msg")).to_have_count(4)
    assert chat.assistant(0).locator(".body").text_content() == answer1
    assert not page.locator("#messages .error-text").count()

    chat.ask("Thanks!")
    assert chat.answer(2)[0] in ("stop", "length")
    assert chat.generates()[3]["messages"] == [{"role": "user", "content": second},
                                               {"role": "assistant", "content": answer2},
                                               {"role": "user", "content": "Thanks!"}]


def test_a_message_too_long_on_its_own_is_still_an_error(new_chat, gateway_url):
    """When even the question alone cannot fit, the error is shown (naming max_new_tokens) and the history that
    was sent before is kept for the next question."""
    from playwright.sync_api import expect

    chat = new_chat(gateway_url)
    page = chat.page
    chat.open()
    chat.settings(temperature="0", max_tokens="4")
    chat.ask("Hi!")
    _, hi = chat.answer(0)
    chat.settings(max_tokens="100000")
    chat.ask("Tell me everything.")
    assert chat.answer(1)[0] == "error"
    expect(chat.assistant(1).locator(".error-text")).to_contain_text("max_new_tokens")
    chat.settings(max_tokens="4")
    chat.ask("Bye!")
    assert chat.answer(2)[0] in ("stop", "length")
    assert chat.generates()[-1]["messages"] == [{"role": "user", "content": "Hi!"},
                                                {"role": "assistant", "content": hi},
                                                {"role": "user", "content": "Bye!"}]
    expect(page.locator("#messages .notice")).to_have_count(0)
