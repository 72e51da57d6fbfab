"""The local pipeline API on the default model: sync, async, streaming, chat, stops, seeds, errors."""
from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

import mii_async
from mii_async.errors import InvalidParameterError, ModelNotFoundError, RequestTooLongError, UnsupportedModelError

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


async def _kv_back_to_idle(pipe, timeout_s: float = 4.0) -> bool:
    """Polls until no KV block is in use (an abort frees blocks within a step)."""
    for _ in range(int(timeout_s / 0.02)):
        if pipe.stats()["used_blocks"] == 0:
            return True
        await asyncio.sleep(0.02)
    return False


def test_chat_answers_paris(default_pipe):
    """The default model answers the capital question greedily, ending on EOS."""
    r = default_pipe.chat(CHAT, max_new_tokens=32)
    assert r.generated_text == "The capital of France is Paris."
    assert r.finish_reason == "stop" and r.generated_length < 32
    assert r.usage.prompt_tokens == r.prompt_length and r.usage.completion_tokens == r.generated_length


def test_response_fields(default_pipe):
    """pipe(prompts) returns one Response per prompt with MII's fields; max_new_tokens gives "length"."""
    rs = default_pipe(["DeepSpeed-MII is", "大模型推理部署的核心难点是"], max_new_tokens=16, ignore_eos=True)
    assert len(rs) == 2
    for r in rs:
        assert r.finish_reason == "length" and r.generated_length == 16 == len(r.token_ids)
        assert r.prompt_length == len(r.prompt_token_ids) > 0 and r.generated_text
    assert default_pipe("Hello", max_new_tokens=2, return_full_text=True)[0].generated_text.startswith("Hello")


def test_stream_concatenation_equals_generate(default_pipe):
    """Streamed deltas, concatenated, equal the generate result for the same seed; the last has usage."""
    params = dict(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=123, ignore_eos=True)
    expected = default_pipe("Write a haiku about the sea.", **params)[0]

    async def collect():
        return [c async for c in default_pipe.stream("Write a haiku about the sea.", **params)]

    chunks = asyncio.run(collect())
    assert "".join(c.text for c in chunks) == expected.generated_text
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 40
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_a_slow_consumer_gets_every_chunk(default_pipe):
    """A consumer that blocks its loop after the first chunk, until the engine has finished the request, still
    reads every token and the chunk with finish_reason (the events fed meanwhile wait in the stream's queue)."""
    async def main():
        chunks = []
        async for c in default_pipe.stream("Tell me about the sea.", max_new_tokens=12, ignore_eos=True):
            chunks.append(c)
            if len(chunks) == 1:
                for _ in range(1500):              # the loop is blocked: the engine's events queue up meanwhile
                    if default_pipe.stats()["used_blocks"] == 0:
                        break
                    time.sleep(0.02)
        return chunks

    chunks = asyncio.run(main())
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12


def test_many_concurrent_streams(default_pipe):
    """32 concurrent streams on one pipeline all complete with their own, correct lengths."""
    async def one(i):
        n = 0
        async for c in default_pipe.stream(f"Count to {i}:", max_new_tokens=4 + i % 5, ignore_eos=True):
            n += len(c.token_ids)
        return n

    async def main():
        return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(main()) == [4 + i % 5 for i in range(32)]


def test_seed_reproduces_whatever_the_batch(default_pipe):
    """A seeded sampled request gives the same text alone and among other requests; another seed differs."""
    params = dict(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    alone = default_pipe("Tell me a story", seed=42, **params)[0].generated_text
    together = default_pipe(["Tell me a story", "Another prompt", "And one more"], seed=42, **params)
    assert together[0].generated_text == alone
    assert default_pipe("Tell me a story", seed=43, **params)[0].generated_text != alone


def test_top_k_one_is_greedy(default_pipe):
    """Sampling with top_k=1 equals greedy decoding."""
    greedy = default_pipe("The best way to learn is", max_new_tokens=16)[0].token_ids
    assert default_pipe("The best way to learn is", max_new_tokens=16, temperature=1.0, top_k=1)[0].token_ids == greedy


def test_stop_string_across_token_boundaries(default_pipe):
    """A stop string spanning two tokens (starting mid-token) ends the request before it, or with it if asked."""
    prompt = "Once upon a time"
    base = default_pipe(prompt, max_new_tokens=30, ignore_eos=True)[0]
    tok = default_pipe.tokenizer
    pieces = [tok.decode(base.token_ids[:i]) for i in range(len(base.token_ids) + 1)]
    # a boundary after token k: the stop string takes the last 2 chars of token k and 2 of token k+1
    k = next(i for i in range(3, len(pieces) - 2)
             if len(pieces[i]) - len(pieces[i - 1]) >= 3 and len(pieces[i + 1]) - len(pieces[i]) >= 3)
    cut = len(pieces[k])
    stop = base.generated_text[cut - 2:cut + 2]
    first = base.generated_text.find(stop)
    r = default_pipe(prompt, max_new_tokens=30, ignore_eos=True, stop=[stop])[0]
    assert r.finish_reason == "stop" and r.generated_text == base.generated_text[:first]
    r = default_pipe(prompt, max_new_tokens=30, ignore_eos=True, stop=stop, include_stop_str_in_output=True)[0]
    assert r.generated_text == base.generated_text[:first + len(stop)]


def test_stop_token_ids_and_min_new_tokens(default_pipe):
    """stop_token_ids end a request on that token; min_new_tokens holds EOS back."""
    base = default_pipe.chat(CHAT, max_new_tokens=32)
    stop_id = base.token_ids[3]
    r = default_pipe.chat(CHAT, max_new_tokens=32, stop_token_ids=[stop_id])
    assert r.token_ids == base.token_ids[:4] and r.finish_reason == "stop"
    tok = default_pipe.tokenizer
    # the stop id's own text is left out, as vLLM does, unless include_stop_str_in_output
    assert r.generated_text == tok.decode(base.token_ids[:3]), r.generated_text
    kept = default_pipe.chat(CHAT, max_new_tokens=32, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert kept.generated_text == tok.decode(base.token_ids[:4]), kept.generated_text
    shown = default_pipe.chat(CHAT, max_new_tokens=32, skip_special_tokens=False)
    assert shown.finish_reason == "stop" and not shown.generated_text.endswith(tok.decode(shown.token_ids[-1:]))
    r = default_pipe.chat(CHAT, max_new_tokens=20, min_new_tokens=20)
    assert r.generated_length == 20 and r.finish_reason == "length"


def test_logprobs(default_pipe):
    """logprobs=n gives each token's logprob and the n best, sorted; greedy picks the best, of rank 1."""
    r = default_pipe("The capital of France is", max_new_tokens=5, logprobs=3)[0]
    assert len(r.logprobs) == 5
    for tid, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == tid and len(lp.top) == 3 and lp.rank == 1
        assert lp.top[0][0] == tid and abs(lp.top[0][1] - lp.logprob) < 1e-6
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0


def test_leaving_a_stream_frees_kv(default_pipe):
    """Breaking out of a stream aborts the request: KV block usage returns to its idle baseline."""
    async def main():
        async for c in default_pipe.stream("Tell me everything about Paris", max_new_tokens=200, ignore_eos=True):
            if len(c.token_ids) and c.text:
                break
        return await _kv_back_to_idle(default_pipe)

    assert asyncio.run(main())
    assert default_pipe.stats()["running"] == 0


def test_cancelling_agenerate_frees_kv(default_pipe):
    """Cancelling an agenerate task aborts its requests and frees their blocks."""
    async def main():
        task = asyncio.create_task(default_pipe.agenerate(["a", "b", "c"], max_new_tokens=500, ignore_eos=True))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _kv_back_to_idle(default_pipe)

    assert asyncio.run(main())


def test_reset_prefix_cache(default_pipe):
    """The local pipeline's reset_prefix_cache: a repeated prompt's blocks are forgotten and computed again."""
    prompt = [1] + [(53 * i) % 4000 + 100 for i in range(40)]
    default_pipe([prompt], max_new_tokens=2)
    assert default_pipe([prompt], max_new_tokens=2)[0].usage.cached_tokens == 32
    assert default_pipe.reset_prefix_cache() >= 2 and default_pipe.stats()["cached_blocks"] == 0
    assert default_pipe([prompt], max_new_tokens=2)[0].usage.cached_tokens == 0


def test_request_errors_name_the_parameter(default_pipe):
    """Impossible or malformed requests fail at once with an error naming the parameter; the engine lives on."""
    with pytest.raises(RequestTooLongError, match="max_new_tokens"):
        default_pipe("hi", max_new_tokens=10**6)
    with pytest.raises(RequestTooLongError) as e:           # the prompt alone leaves no room: it is named
        default_pipe([[5] * 200_000], max_new_tokens=1)
    assert e.value.param == "prompt" and "200000 tokens leave no room" in str(e.value)
    with pytest.raises(InvalidParameterError, match="prompt"):
        default_pipe([3.5])
    with pytest.raises(InvalidParameterError, match="prompt"):
        default_pipe([[10**9]])
    with pytest.raises(InvalidParameterError, match="temperature"):
        default_pipe("hi", temperature=float("nan"))
    with pytest.raises(InvalidParameterError, match="messages"):
        default_pipe.chat([{"role": "user"}])
    assert default_pipe("hi", max_new_tokens=2)[0].generated_length >= 1


def test_a_prompt_no_tokenizer_could_fit_is_refused_before_it_is_encoded(default_pipe, monkeypatch):
    """A text or chat of more than MAX_CHARS_PER_TOKEN characters a token of the context is refused naming
    `prompt` or `messages` without reaching the tokenizer; the pipeline serves on."""
    from mii_async.text.prompts import MAX_CHARS_PER_TOKEN

    calls = []
    encode = default_pipe._encoder.encode
    monkeypatch.setattr(default_pipe._encoder, "encode", lambda *a, **k: calls.append(a[0]) or encode(*a, **k))
    limits = default_pipe._engine.engine.limits
    n = MAX_CHARS_PER_TOKEN * min(limits.max_model_len, limits.max_request_tokens) + 1
    with pytest.raises(RequestTooLongError) as e:
        default_pipe("a" * n, max_new_tokens=1)
    assert e.value.param == "prompt" and f"{n} characters" in str(e.value)
    with pytest.raises(RequestTooLongError) as e:
        default_pipe.chat([{"role": "user", "content": "a" * (n - 1)}, {"role": "user", "content": "b"}])
    assert e.value.param == "messages"
    assert calls == []
    assert default_pipe("hi", max_new_tokens=2)[0].generated_length >= 1 and calls == ["hi"]


def test_model_errors(tmp_path):
    """Unknown names say what was tried; an unsupported model_type lists the supported ones."""
    with pytest.raises(ModelNotFoundError, match="tried"):
        mii_async.pipeline(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="local hub cache"):
        mii_async.pipeline("someorg/not-a-cached-model")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="llama"):
        mii_async.pipeline(str(tmp_path))
    # a Llama whose MLP is not what the layers compute is refused, not run wrongly
    for extra, name in (({"hidden_act": "gelu"}, "hidden_act"), ({"mlp_bias": True}, "mlp_bias")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **extra}))
        with pytest.raises(UnsupportedModelError, match=name):
            mii_async.pipeline(str(tmp_path))


def test_text_that_is_not_unicode_names_the_field(default_pipe):
    """A lone surrogate (legal in a str, not text) in a prompt, a message or a stop string is refused by name."""
    for prompt, params, param in (("hi \ud800", {}, "prompt"), ("hi", {"stop": ["ok", "\udc00"]}, "stop[1]"),
                                  ([{"role": "user", "content": "\ud83d"}], {}, "messages[0].content")):
        with pytest.raises(InvalidParameterError) as e:
            default_pipe(prompt, max_new_tokens=2, **params)
        assert e.value.param == param and "lone surrogate" in str(e.value)


def test_a_tiny_temperature_is_greedy(default_pipe):
    """Logits divided by 1e-38 overflow: temperatures under 1e-5 sample greedily, as vLLM's do."""
    greedy = default_pipe(CHAT, max_new_tokens=12)[0]
    tiny = default_pipe(CHAT, max_new_tokens=12, temperature=1e-38)[0]
    assert tiny.token_ids == greedy.token_ids and "Paris" in tiny.generated_text


def test_closed_pipeline_rejects(default_model_dir):
    """After close(), calls raise EngineClosedError; close is idempotent."""
    pipe = mii_async.pipeline(str(default_model_dir), kv_cache_memory=0.05)
    pipe.close()
    pipe.close()
    with pytest.raises(mii_async.EngineClosedError):
        pipe("hi")


def test_engine_is_built_and_stepped_on_its_own_thread(default_model_dir, monkeypatch):
    """The engine is built on the thread that runs its steps, so the caller's thread runs none of its torch ops
    (with torch's OpenMP, a second thread's parallel regions make every small op of a step start from sleep).
    A load error there, or a failed import, is raised in the caller, and leaves no engine thread behind."""
    import sys
    import threading

    from mii_async.workers.engine import Engine

    seen: dict[str, set[str]] = {"init": set(), "step": set()}
    init, step = Engine.__init__, Engine.step

    def traced_init(self, *a, **kw):
        seen["init"].add(threading.current_thread().name)
        init(self, *a, **kw)

    def traced_step(self, *a, **kw):
        seen["step"].add(threading.current_thread().name)
        return step(self, *a, **kw)

    monkeypatch.setattr(Engine, "__init__", traced_init)
    monkeypatch.setattr(Engine, "step", traced_step)
    with mii_async.pipeline(str(default_model_dir), kv_cache_memory=0.05) as pipe:
        assert pipe("The capital of France is", max_new_tokens=2)[0].generated_length == 2
    assert seen == {"init": {"mii_async-engine"}, "step": {"mii_async-engine"}}

    def failing_init(self, *a, **kw):
        raise RuntimeError("no memory for the KV pool")

    monkeypatch.setattr(Engine, "__init__", failing_init)
    before = {t for t in threading.enumerate() if t.name == "mii_async-engine"}
    with pytest.raises(RuntimeError, match="no memory for the KV pool"):
        mii_async.pipeline(str(default_model_dir), kv_cache_memory=0.05)
    monkeypatch.setitem(sys.modules, "mii_async.workers.engine", None)    # an import that fails there
    with pytest.raises(ImportError):
        mii_async.pipeline(str(default_model_dir), kv_cache_memory=0.05)
    for t in {t for t in threading.enumerate() if t.name == "mii_async-engine"} - before:
        t.join(timeout=5)
        assert not t.is_alive()


def test_guided_choice_and_a_guide_that_cannot_compile(default_pipe):
    """guided_choice through the pipeline answers one of the choices, for each prompt of a call; a regex the
    replica can never compile is refused naming guided_regex, called or streamed, with a hint for anchors."""
    answers = default_pipe(["Is Paris in France? Answer:", "x"], max_new_tokens=8, guided_choice=["yes", "no"])
    assert all(r.generated_text in ("yes", "no") and r.finish_reason == "stop" for r in answers)
    with pytest.raises(InvalidParameterError) as e:
        default_pipe("x", max_new_tokens=4, guided_regex="a(?=b)")
    assert e.value.param == "guided_regex" and "cannot be compiled" in str(e.value)

    async def stream():
        async for _ in default_pipe.stream("x", max_new_tokens=4, guided_regex="^(yes|no)$"):
            pass

    with pytest.raises(InvalidParameterError) as e:
        asyncio.run(stream())
    assert e.value.param == "guided_regex" and "leave out the anchors" in str(e.value)
    assert default_pipe.stats()["used_blocks"] == 0
    # the dialect is outlines-core's: an escape Python's re does not know is fine
    [word] = default_pipe("The capital of France is", max_new_tokens=8, guided_regex=r" \p{Lu}\p{Ll}+\.")
    assert re.fullmatch(r" [A-Z][a-z]+\.", word.generated_text) and word.finish_reason == "stop", word


def test_guides_in_a_script_without_a_main_guard(default_model_dir, tmp_path):
    """A plain script (no `if __name__ == "__main__"`) that asks for a guide runs once: the guide compiler's
    process does not run the caller's script again."""
    import subprocess
    import sys

    script = tmp_path / "plain.py"
    script.write_text(f"import mii_async\nprint('START', flush=True)\n"
                      f"pipe = mii_async.pipeline({str(default_model_dir)!r}, kv_cache_memory=0.05)\n"
                      f"print('ANSWER', pipe('Is Paris in France?', max_new_tokens=4, "
                      f"guided_choice=['yes', 'no'])[0].generated_text, flush=True)\npipe.close()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("START") == 1 and out.stdout.split("ANSWER ")[1].strip() in ("yes", "no"), out.stdout
