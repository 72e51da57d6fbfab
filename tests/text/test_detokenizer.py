"""IncrementalDetokenizer against a real byte-level BPE tokenizer: full-decode equality, UTF-8, stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mii_async.text.detokenizer import Delta, IncrementalDetokenizer

import transformers

# Few examples each: the whole module must run in seconds on two cores.
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# English, Chinese, emoji (4-byte, with a ZWJ sequence), whitespace: splits characters across tokens.
PIECES = [*"abcdefghij ABC.,!?\n\t0123", *"你好世界，。中文字", "🎉", "😀", "👍🏽", "👨‍👩‍👧", "é", "ß",
          " the", "User:"]
TEXTS = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    """The default model's tokenizer (byte-level BPE)."""
    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def byte_ids(tok) -> dict[int, int]:
    """Byte → id of its single-byte token, for bytes ≥ 0x80 (the pieces of split characters) the vocab has."""
    # GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest map to U+0100 onwards.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    to_char = {b: chr(b) for b in printable} | {b: chr(0x100 + n) for n, b in enumerate(others)}
    vocab = tok.get_vocab()
    ids = {b: vocab[to_char[b]] for b in range(0x80, 0x100) if to_char[b] in vocab}
    assert full_decode(tok, [ids[0xE4], ids[0xBD], ids[0xA0]]) == "你", "not a byte-level BPE tokenizer"
    return ids


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def full_decode(tok, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def run(detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]) -> tuple[list[Delta], str]:
    """Push each chunk until a stop; return the deltas and what flush adds (\"\" once stopped)."""
    deltas = []
    for chunk in chunks:
        deltas.append(detok.push(chunk))
        if deltas[-1].stopped:
            return deltas, ""
    return deltas, detok.flush()


def one_by_one(ids: Sequence[int]) -> list[list[int]]:
    return [[i] for i in ids]


@st.composite
def chunked(draw, ids: list[int]) -> list[list[int]]:
    """`ids` cut at random places into consecutive pushes."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids))))
    bounds = [0, *(c for c in cuts if c < len(ids)), len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def reference_stop(text: str, stop: Sequence[str], include: bool) -> tuple[str, str | None]:
    """What a character-at-a-time stop check gives on the full text: first match to complete, earliest start."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stop if s and s in text]
    if not hits:
        return text, None
    end, start, s = min(hits)
    return text[:end] if include else text[:start], s


@SETTINGS
@given(prompt=TEXTS, text=TEXTS, skip=st.booleans(), data=st.data())
def test_matches_full_decode_on_real_text(tok, prompt, text, skip, data):
    """Emitted text (pushes + flush) equals a full decode of the generated ids, however they are batched."""
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, encode(tok, prompt), skip_special_tokens=skip)
    deltas, rest = run(detok, data.draw(chunked(ids)))
    assert "".join(d.text for d in deltas) + rest == full_decode(tok, ids, skip)
    assert detok.text == full_decode(tok, ids, skip)
    assert not any(d.stopped for d in deltas)


@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_matches_full_decode_on_random_ids(tok, byte_ids, data, skip):
    """Random ids (any token, special tokens, loose and runs of bytes) still decode to the full decode."""
    chars = st.sampled_from(["你", "🎉", "é", "👨‍👩‍👧"])
    char_bytes = chars.map(lambda c: [byte_ids[b] for b in c.encode()])
    segment = st.one_of(
        st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=3),  # any token
        st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=10),  # special tokens
        st.lists(st.sampled_from(sorted(byte_ids.values())), min_size=1, max_size=12),  # stray bytes
        char_bytes,  # a character split into its bytes
    )
    ids_of = st.lists(segment, max_size=8).map(lambda segs: [i for seg in segs for i in seg])
    prompt, ids = data.draw(ids_of), data.draw(ids_of)
    detok = IncrementalDetokenizer(tok, prompt[-8:], skip_special_tokens=skip)
    deltas, rest = run(detok, data.draw(chunked(ids)))
    assert "".join(d.text for d in deltas) + rest == full_decode(tok, ids, skip)


@SETTINGS
@given(text=TEXTS)
def test_no_replacement_char_for_valid_text(tok, text):
    """Valid text pushed one token at a time never shows U+FFFD, not even in a delta before flush."""
    deltas, rest = run(IncrementalDetokenizer(tok, []), one_by_one(encode(tok, text)))
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) + rest == text


def test_split_characters_are_held_until_complete(tok):
    """"你好，世界 🎉" one token at a time: characters split across tokens appear whole, never as U+FFFD."""
    text = "你好，世界 🎉"
    ids = encode(tok, text)
    assert any("\ufffd" in full_decode(tok, [i]) for i in ids), "text must split characters across tokens"
    detok = IncrementalDetokenizer(tok, encode(tok, "Say hello:"))
    deltas = [detok.push([i]) for i in ids]
    assert all("\ufffd" not in d.text for d in deltas)
    assert any(d.text == "" for d in deltas)  # something was held back
    assert "".join(d.text for d in deltas) == text
    assert detok.flush() == ""


def test_invalid_trailing_bytes_appear_on_flush(tok, byte_ids):
    """A character left incomplete at the end is held back, then flushed as U+FFFD as a full decode shows it."""
    ids = encode(tok, "ok ") + [byte_ids[0xE4]]  # a lone lead byte of a 3-byte character
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.push([i]).text for i in ids) == "ok "
    assert detok.flush() == "\ufffd" == full_decode(tok, ids)[len("ok "):]


def test_long_invalid_byte_runs_are_released(tok, byte_ids):
    """A long run of stray continuation bytes is emitted before flush: the pending window stays bounded."""
    ids = [byte_ids[0x80]] * 40
    detok = IncrementalDetokenizer(tok, [])
    shown = "".join(detok.push([i]).text for i in ids)
    assert len(shown) >= 40 - 8
    assert shown + detok.flush() == full_decode(tok, ids)


def test_first_token_leading_space_matches_full_decode(tok):
    """The first generated token's leading space is kept, as in the decode of the generated ids."""
    prompt, ids = encode(tok, "The capital of France is"), encode(tok, " Paris.")
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.push(ids[:1]).text == full_decode(tok, ids[:1]) == " Paris"


def test_stop_string_spanning_tokens(tok):
    """A stop string spread over several tokens and starting mid-token ends the output just before it."""
    text = "Hello world, this is the END of it"
    ids = encode(tok, text)
    stop = "llo world, th"  # starts inside "Hello", ends inside "this"
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    deltas, _ = run(detok, one_by_one(ids))
    assert deltas[-1] == Delta(deltas[-1].text, True, stop)
    assert len(deltas) < len(ids)  # stopped as soon as the stop string was complete
    assert detok.text == "He"
    with pytest.raises(AssertionError):
        detok.push(ids[-1:])


def test_stop_string_at_start(tok):
    """A stop string at the very start of the output stops with empty text."""
    ids = encode(tok, "\n\nUser: hi")
    detok = IncrementalDetokenizer(tok, encode(tok, "Assistant: hello"), stop=["\n\nUser:"])
    deltas, rest = run(detok, one_by_one(ids))
    assert deltas[-1].stopped and deltas[-1].stop_str == "\n\nUser:"
    assert all(d.text == "" for d in deltas) and rest == "" and detok.text == ""


def test_stop_strings_wait_for_min_new_tokens(tok):
    """Before min_new_tokens ids exist a stop string is ordinary text; from the id that reaches it on, text is
    looked at again (vLLM's rule), so a later occurrence stops the request."""
    text = "Tom went home. Then Tom slept."
    ids = encode(tok, text)
    first = full_decode(tok, ids).index("Tom", 1)
    reach = next(n for n in range(1, len(ids) + 1) if len(full_decode(tok, ids[:n])) > first)   # its id
    detok = IncrementalDetokenizer(tok, [], stop=["Tom"], min_new_tokens=reach - 1)
    deltas, _ = run(detok, one_by_one(ids))
    assert deltas[-1].stopped and detok.text == "Tom went home. Then "
    detok = IncrementalDetokenizer(tok, [], stop=["Tom"], min_new_tokens=reach + 1)
    deltas, rest = run(detok, one_by_one(ids))
    assert not any(d.stopped for d in deltas) and detok.text == text
    # a stop string that starts before the threshold and ends after it stops the request
    dot = next(n for n in range(1, len(ids) + 1) if full_decode(tok, ids[:n]).endswith("home."))
    detok = IncrementalDetokenizer(tok, [], stop=["home. Then"], min_new_tokens=dot)
    deltas, _ = run(detok, one_by_one(ids))
    assert deltas[-1].stopped and detok.text == "Tom went "


def test_partial_stop_string_is_held_then_released(tok):
    """Text that only starts like the stop string is held back, never leaked, then released when it diverges."""
    stop = "\n\nUser:"
    text = "Hi\n\nUs\n\nUsers are\n\n"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    for n in range(1, len(ids) + 1):
        delta = detok.push(ids[n - 1:n])
        assert not delta.stopped
        so_far = full_decode(tok, ids[:n])
        held = max((k for k in range(len(stop)) if so_far.endswith(stop[:k])), default=0)
        assert detok.text == so_far[:len(so_far) - held]  # exactly the longest possible stop prefix is held
    assert detok.text == "Hi\n\nUs\n\nUsers are"
    assert detok.flush() == "\n\n" and detok.text == text


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(tok, include):
    """include_stop_str_in_output appends the matched stop string to the text, and nothing after it."""
    ids = encode(tok, "Answer: 42. STOP and more text")
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=include)
    deltas, _ = run(detok, [ids])
    assert deltas == [Delta("Answer: 42. STOP" if include else "Answer: 42. ", True, "STOP")]


def test_multiple_stop_strings_pick_the_earliest(tok):
    """Of several stop strings in one push, the earliest in the text wins, not the first listed."""
    ids = encode(tok, "one two three four")
    detok = IncrementalDetokenizer(tok, [], stop=["four", "three", "two"])
    assert detok.push(ids) == Delta("one ", True, "two")
    # Matches ending at the same character: the one starting earlier wins.
    detok = IncrementalDetokenizer(tok, [], stop=["User:", "\n\nUser:"])
    assert detok.push(encode(tok, "Hi\n\nUser: x")) == Delta("Hi", True, "\n\nUser:")


def test_empty_stop_strings_are_ignored(tok):
    """An empty stop string never matches."""
    ids = encode(tok, "plain text")
    deltas, rest = run(IncrementalDetokenizer(tok, [], stop=["", "zzz"]), one_by_one(ids))
    assert "".join(d.text for d in deltas) + rest == "plain text"


@SETTINGS
@given(text=TEXTS, data=st.data(), include=st.booleans())
def test_batched_push_equals_one_by_one_with_stops(tok, text, data, include):
    """Pushing several ids at once gives the same text and stop as one by one, and as a full-text stop check."""
    ids = encode(tok, text)
    full = full_decode(tok, ids)
    # Stop strings taken from the text (so they hit, often across tokens) plus one that may not.
    pieces = data.draw(st.lists(st.tuples(st.integers(0, len(full)), st.integers(1, 4)), max_size=3))
    stop = [full[a:a + n] for a, n in pieces if full[a:a + n]] + [data.draw(TEXTS)]
    results = []
    for chunks in (one_by_one(ids), data.draw(chunked(ids)), [ids]):
        detok = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
        deltas, rest = run(detok, chunks)
        results.append(("".join(d.text for d in deltas) + rest, deltas[-1].stop_str if deltas else None))
    assert results[0] == results[1] == results[2] == reference_stop(full, stop, include)


def test_the_backend_fast_path_is_taken_only_where_decoding_is_not_customized(tok):
    """The default tokenizer decodes through its `tokenizers` backend directly (what the full-decode tests
    above check against transformers' own decode); a subclass that overrides decode is left to it."""
    from mii_async.text.detokenizer import _backend_decode

    assert _backend_decode(tok, True) is not None and IncrementalDetokenizer(tok, [])._fast is not None

    class Custom(type(tok)):
        def decode(self, token_ids, **kw):
            return "x" * len(token_ids)

    custom = object.__new__(Custom)
    custom.__dict__.update(tok.__dict__)
    assert _backend_decode(custom, True) is None
    detok = IncrementalDetokenizer(custom, [])
    assert detok._fast is None and detok.push([5]).text == "x" and detok.push([6, 7]).text == "xx"
