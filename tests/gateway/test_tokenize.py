"""POST /tokenize and /detokenize on a real gateway: the ids are those the generation routes run (their usage
counts agree), and bad bodies get a 400 naming the parameter."""
from __future__ import annotations

import httpx
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_tokenize_text_and_messages_as_generation_runs_them(gateway_url, tokenizer, deployment):
    """A text prompt's ids are the tokenizer's; a chat's are its template's, and both counts equal the
    prompt_tokens that completions and chat completions report for the same prompt."""
    text = "The capital of France is"
    r = _post(gateway_url, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == deployment.run(deployment.health())["limits"]["max_model_len"]
    done = _post(gateway_url, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == body["count"]

    chat = _post(gateway_url, "/tokenize", {"messages": QUESTION}).json()
    template = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(template, add_special_tokens=False)["input_ids"]
    answered = _post(gateway_url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1}).json()
    assert answered["usage"]["prompt_tokens"] == chat["count"] and "token_strs" not in chat
    bare = _post(gateway_url, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]


def test_detokenize_round_trip(gateway_url):
    text = "Paris is the capital of France. 大模型"
    ids = _post(gateway_url, "/tokenize", {"prompt": text}).json()["tokens"]
    r = _post(gateway_url, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "a", "messages": QUESTION}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "temperature": 1}, "temperature"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_bodies_name_the_parameter(gateway_url, path, body, param):
    r = _post(gateway_url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_is_404(gateway_url):
    r = _post(gateway_url, "/tokenize", {"model": "no-such-model", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
