"""The chat page (/, /static/chat.{css,js}) in a real browser: Debian's chromium, headless, driven by playwright,
against a real gateway in front of the session's deployment of the default model (SmolLM2-135M-Instruct, CPU).

Skipped when chromium or playwright is missing, unless MII_ASYNC_REQUIRE_BROWSER=1 (then such a run fails).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parents[2] / "test-artifacts"
ANSWER_MS = 60_000        # the CPU model streams ~5-50 tokens/s, depending on what else runs
CONNECT_MS = 30_000


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is not installed"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    return None


MISSING = _missing()
REQUIRE = os.environ.get("MII_ASYNC_REQUIRE_BROWSER") == "1"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None and not REQUIRE, reason=f"no browser: {MISSING}")]

# Records, in the page, every distinct state of the newest assistant message (and the buttons' states with it),
# at each DOM change: tokens arrive one WebSocket frame (one task) at a time, so each streamed step shows here.
RECORD_STATES = """() => {
  window.__states = [];
  const m = document.getElementById("messages");
  const send = document.getElementById("send"), stop = document.getElementById("stop");
  new MutationObserver(() => {
    const all = m.querySelectorAll(".msg.assistant");
    if (!all.length) return;
    const a = all[all.length - 1];
    const s = {text: a.querySelector(".body").textContent, streaming: a.classList.contains("streaming"),
               finish: a.getAttribute("data-finish"), sendDisabled: send.disabled, stopDisabled: stop.disabled};
    const last = window.__states[window.__states.length - 1];
    if (!last || JSON.stringify(last) !== JSON.stringify(s)) window.__states.push(s);
  }).observe(m, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


class Chat:
    """One page of the chat UI, with what it requested, logged and sent/received on its WebSockets."""

    def __init__(self, page, base_url: str) -> None:
        self.page, self.base = page, base_url
        self.requests: list[str] = []
        self.sockets: list[str] = []
        self.console_errors: list[str] = []
        self.sent: list[dict] = []
        self.received: list[dict] = []
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.console_errors.append(f"uncaught: {e}"))
        page.on("websocket", self._on_websocket)

    def _on_websocket(self, ws) -> None:
        self.sockets.append(ws.url)
        ws.on("framesent", lambda payload: self.sent.append(json.loads(payload)))
        ws.on("framereceived", lambda payload: self.received.append(json.loads(payload)))

    def open(self, query: str = "") -> None:
        from playwright.sync_api import expect

        self.page.goto(f"{self.base}/{query}")
        expect(self.page.locator("#status")).to_have_attribute("data-state", "connected", timeout=CONNECT_MS)

    def settings(self, **values: str) -> None:
        for name, value in values.items():
            self.page.fill(f"#{name.replace('_', '-')}", value)

    def ask(self, text: str, *, enter: bool = False) -> None:
        self.page.fill("#prompt", text)
        if enter:
            self.page.press("#prompt", "Enter")
        else:
            self.page.click("#send")

    def assistant(self, i: int):
        return self.page.locator(".msg.assistant").nth(i)

    def answer(self, i: int) -> tuple[str, str]:
        """Waits for the i-th assistant message to end; returns (finish_reason, its text)."""
        from playwright.sync_api import expect

        msg = self.assistant(i)
        expect(msg).to_have_attribute("data-finish", re.compile(r".+"), timeout=ANSWER_MS)
        return msg.get_attribute("data-finish"), msg.locator(".body").text_content()

    def generates(self) -> list[dict]:
        return [f for f in self.sent if f.get("type") == "generate"]


@pytest.fixture(scope="module")
def browser():
    if MISSING is not None:
        pytest.fail(f"MII_ASYNC_REQUIRE_BROWSER=1 but {MISSING}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def new_chat(browser):
    """Opens Chat pages, each in a fresh browser context (its own storage); closes them at the end."""
    contexts = []

    def make(base_url: str) -> Chat:
        ctx = browser.new_context(viewport={"width": 1180, "height": 820})
        contexts.append(ctx)
        return Chat(ctx.new_page(), base_url)

    yield make
    for ctx in contexts:
        ctx.close()


def test_streams_a_multi_turn_conversation(new_chat, gateway_url):
    """A greedy question streams token by token into one assistant message that ends "stop" and says Paris; the
    next question is sent with the whole conversation, and the page then shows 4 messages."""
    from playwright.sync_api import expect

    chat = new_chat(gateway_url)
    page = chat.page
    chat.open()
    expect(page.locator("#status")).to_contain_text("SmolLM2-135M-Instruct")
    chat.settings(temperature="0")
    page.evaluate(RECORD_STATES)
    chat.ask("What is the capital of France?")

    finish, text = chat.answer(0)
    assert finish == "stop", text
    assert "Paris" in text
    states = page.evaluate("window.__states")
    streamed = [s for s in states if s["streaming"] and s["finish"] is None and s["text"]]
    texts = list(dict.fromkeys(s["text"] for s in streamed))
    assert len(texts) >= 2, f"the answer did not arrive in steps: {states}"
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and text.startswith(texts[-1]), texts
    assert all(s["sendDisabled"] and not s["stopDisabled"] for s in streamed), "Send/Stop wrong while streaming"
    assert not states[-1]["streaming"] and states[-1]["finish"] == "stop"
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()

    first = chat.generates()[0]
    assert first["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    assert (first["max_new_tokens"], first["temperature"], first["top_p"]) == (256, 0, 0.9) and "seed" not in first

    chat.ask("And what is the capital of Germany?")
    finish2, text2 = chat.answer(1)
    assert finish2 in ("stop", "length") and text2.strip()
    msgs = page.locator("#messages .msg")
    expect(msgs).to_have_count(4)
    assert [msgs.nth(i).get_attribute("class").split()[1] for i in range(4)] == ["user", "assistant"] * 2
    second = chat.generates()[1]
    assert second["messages"] == [{"role": "user", "content": "What is the capital of France?"},
                                  {"role": "assistant", "content": text},
                                  {"role": "user", "content": "And what is the capital of Germany?"}]
    assert second["id"] != first["id"]

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat_page.png"))


def test_stop_keeps_the_partial_answer(new_chat, gateway_url):
    """Stop cancels the running request: its partial answer stays, marked "abort", Send is enabled again, and the
    next question (sent with Enter) is answered with the stopped answer in its history."""
    from playwright.sync_api import expect

    chat = new_chat(gateway_url)
    page = chat.page
    chat.open()
    chat.settings(max_tokens="400", temperature="0")               # greedy: the same long story every time
    chat.ask("Write a long story about a dragon.", enter=True)
    expect(page.locator("#send")).to_be_disabled()
    expect(page.locator("#stop")).to_be_enabled()
    story = chat.assistant(0)
    expect(story).to_have_class(re.compile(r"\bstreaming\b"))
    expect(story.locator(".body")).to_have_text(re.compile(r"\S.{10,}", re.S), timeout=ANSWER_MS)
    chat.ask("A second question meanwhile", enter=True)               # one at a time: it waits in the box
    assert len(chat.generates()) == 1 and page.input_value("#prompt") == "A second question meanwhile"
    page.click("#stop")

    finish, partial = chat.answer(0)
    assert finish == "abort"
    assert partial.strip()
    expect(story).not_to_have_class(re.compile(r"\bstreaming\b"))
    expect(story.locator(".meta")).to_contain_text("Stopped")
    req_id = chat.generates()[0]["id"]
    assert {"type": "cancel", "id": req_id} in chat.sent
    done = [f for f in chat.received if f.get("type") == "done" and f.get("id") == req_id]
    assert done and done[0]["finish_reason"] == "abort", "the server did not confirm the cancel"
    assert done[0]["usage"]["completion_tokens"] < 400
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()

    chat.settings(max_tokens="24")
    chat.ask("What is 2+2?", enter=True)
    finish2, text2 = chat.answer(1)
    assert finish2 in ("stop", "length") and text2.strip()
    expect(page.locator("#messages .msg")).to_have_count(4)
    assert story.locator(".body").text_content() == partial            # the stopped answer stayed as it was
    assert chat.generates()[1]["messages"][1] == {"role": "assistant", "content": partial}


def test_loads_nothing_from_other_hosts(new_chat, gateway_url):
    """The page, through a whole exchange, requests nothing but the gateway (HTTP and ws://) and logs no errors."""
    chat = new_chat(gateway_url)
    chat.open()
    chat.settings(max_tokens="8")
    chat.ask("Hello!")
    finish, _ = chat.answer(0)
    assert finish in ("stop", "length")

    port = urlsplit(gateway_url).port
    allowed = (f"{gateway_url}/", f"ws://127.0.0.1:{port}/")
    urls = chat.requests + chat.sockets
    assert {f"{gateway_url}/", f"{gateway_url}/static/chat.css", f"{gateway_url}/static/chat.js"} <= set(urls)
    assert chat.sockets == [f"ws://127.0.0.1:{port}/v1/ws"]
    # data: is the page's inline icon (no host at all).
    assert [u for u in urls if not u.startswith(allowed) and not u.startswith("data:")] == []
    assert chat.console_errors == []


def test_new_chat_settings_and_errors(new_chat, gateway_url):
    """Shift+Enter is a newline; invalid settings are refused in the page; a server error shows in the conversation;
    text is shown as text, not HTML; New chat clears the view and the history sent next."""
    from playwright.sync_api import expect

    chat = new_chat(gateway_url)
    page = chat.page
    chat.open()
    page.click("#prompt")
    page.keyboard.type("Say hello")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("in one word.")
    assert page.input_value("#prompt") == "Say hello\nin one word."
    expect(page.locator("#messages .msg")).to_have_count(0)

    chat.settings(top_p="0")                                        # top_p must be in (0, 1]
    page.click("#send")
    expect(page.locator('.field-error[data-for="top-p"]')).not_to_be_empty()
    expect(page.locator("#top-p")).to_have_attribute("aria-invalid", "true")
    assert chat.generates() == [] and page.input_value("#prompt") == "Say hello\nin one word."
    chat.settings(top_p="0.9", seed="7", max_tokens="100000")       # past the model's context: the server refuses
    page.click("#send")
    finish, _ = chat.answer(0)
    assert finish == "error"
    expect(chat.assistant(0).locator(".error-text")).to_contain_text("max_new_tokens")
    assert chat.generates()[0]["seed"] == 7
    assert chat.generates()[0]["messages"] == [{"role": "user", "content": "Say hello\nin one word."}]
    expect(page.locator("#send")).to_be_enabled()

    chat.settings(max_tokens="8", system="You are terse.")
    markup = 'Hi <b>there</b> <img src=x onerror="window.__xss=1">'
    chat.ask(markup)
    assert chat.answer(1)[0] in ("stop", "length")
    assert page.locator("#messages .msg.user .body").nth(1).text_content() == markup   # text, never HTML
    expect(page.locator("#messages b, #messages img")).to_have_count(0)
    assert page.evaluate("window.__xss") is None
    # The failed turn is not history: the system prompt, then only this question.
    assert chat.generates()[1]["messages"] == [{"role": "system", "content": "You are terse."},
                                               {"role": "user", "content": markup}]
    page.click("#new-chat")
    expect(page.locator("#messages .msg")).to_have_count(0)
    chat.ask("Hi again")
    assert chat.answer(0)[0] in ("stop", "length")
    assert chat.generates()[2]["messages"] == [{"role": "system", "content": "You are terse."},
                                               {"role": "user", "content": "Hi again"}]


def test_api_key_from_the_page_address(new_chat, start_gateway):
    """On a gateway with an API key, the page opened with ?api_key=KEY loads and passes the key on to /v1/ws."""
    from playwright.sync_api import expect

    key = "chat-page-key"
    gw = start_gateway(api_key=key)
    chat = new_chat(gw.url)
    chat.open(f"?api_key={key}")
    expect(chat.page.locator("#status")).to_contain_text("Connected")
    port = urlsplit(gw.url).port
    assert {f"{gw.url}/static/chat.css?api_key={key}", f"{gw.url}/static/chat.js?api_key={key}"} <= set(chat.requests)
    assert chat.sockets == [f"ws://127.0.0.1:{port}/v1/ws?api_key={key}"]
    assert chat.console_errors == []


def test_reconnects_after_a_drop(new_chat, start_gateway):
    """When the gateway goes away the status turns "disconnected"; once one listens again the page reconnects."""
    from playwright.sync_api import expect

    gw = start_gateway()
    chat = new_chat(gw.url)
    chat.open()
    status = chat.page.locator("#status")
    gw.stop()
    expect(status).to_have_attribute("data-state", "disconnected", timeout=CONNECT_MS)
    expect(status).to_contain_text("reconnecting")
    expect(chat.page.locator("#send")).to_be_disabled()
    again = start_gateway(http_port=urlsplit(gw.url).port)
    assert again.url == gw.url
    expect(status).to_have_attribute("data-state", "connected", timeout=CONNECT_MS)
    assert len(chat.sockets) >= 2
    chat.settings(max_tokens="4")
    chat.ask("Hello again!")
    assert chat.answer(0)[0] in ("stop", "length")
