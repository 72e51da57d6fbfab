"""Streamed text equals a one-shot decode of the same ids, however they are grouped into pushes: byte-level BPE
and SentencePiece-style byte fallback, special tokens skipped or shown, stop strings, min_new_tokens, and a
RequestState's chunks (text, ids, logprobs, usage) kept aligned."""
from __future__ import annotations

import codecs
from types import SimpleNamespace as NS

import pytest
import transformers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mii_async.outputs import Logprob
from mii_async.params import SamplingParams
from mii_async.text.detokenizer import MAX_HELD_RUN_IDS, IncrementalDetokenizer
from mii_async.text.request_state import Ended, RequestState
from mii_async.text.token_bytes import TokenSpeller
from tests.text.spm_tokenizers import byte_id, spm_tokenizer

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHARS = ["你", "🎉", "é", "𝄞"]
N_SPM = len(spm_tokenizer())  # the last id is the added token "<tool>"


@pytest.fixture(scope="module")
def spm():
    """Both SentencePiece-style decoders: with the first space stripped (Llama-2) and without (Gemma)."""
    return [spm_tokenizer(True), spm_tokenizer(False)]


@pytest.fixture(scope="module")
def bbpe(default_model_dir):
    """The default model's byte-level BPE tokenizer, and its byte → id map for bytes ≥ 0x80 it has."""
    tok = transformers.AutoTokenizer.from_pretrained(str(default_model_dir))
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    to_char = {b: chr(b) for b in printable} | {b: chr(0x100 + n) for n, b in enumerate(others)}
    vocab = tok.get_vocab()
    return tok, {b: vocab[to_char[b]] for b in range(0x80, 0x100) if to_char[b] in vocab}


def ids_strategy(n_vocab: int, specials: list[int], byte_ids: dict[int, int]):
    """Random ids: any token, runs of special tokens, stray high bytes, characters split into byte tokens."""
    stray = sorted(i for b, i in byte_ids.items() if b >= 0x80)
    segment = st.one_of(
        st.lists(st.integers(0, n_vocab - 1), min_size=1, max_size=3),
        st.lists(st.sampled_from(specials), min_size=1, max_size=4),
        st.lists(st.sampled_from(stray), min_size=1, max_size=6),
        st.sampled_from(CHARS).map(lambda c: [byte_ids[b] for b in c.encode()]),
    )
    return st.lists(segment, max_size=7).map(lambda segs: [i for seg in segs for i in seg])


def spm_ids():
    return ids_strategy(N_SPM, [0, 1, 2, N_SPM - 1, N_SPM + 3], {b: byte_id(b) for b in range(256)})  # (+ unknown)


@st.composite
def grouped(draw, ids: list[int]) -> list[list[int]]:
    """`ids` cut at random places into consecutive pushes."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids))))
    bounds = [0, *(c for c in cuts if c < len(ids)), len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def decode(tok, ids, skip: bool) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(detok: IncrementalDetokenizer, pushes, last_ends: bool = False) -> tuple[str, str | None]:
    """Push each group until a stop, then flush; the text and the stop string matched."""
    out = ""
    for k, ids in enumerate(pushes):
        d = detok.push(ids, stop_terminated=last_ends and k == len(pushes) - 1)
        out += d.text
        if d.stopped:
            return out, d.stop_str
    return out + detok.flush(), detok.stop_str


def reference_stop(text: str, stop, include: bool) -> tuple[str, str | None]:
    """A one-shot search of the decoded text: the match that completes first, the earliest starting among those."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    end, start, s = min(hits)
    return (text[:end] if include else text[:start]), s


def longest_byte_run(ids: list[int]) -> int:
    run = best = 0
    for i in ids:
        run = run + 1 if byte_id(0) <= i < byte_id(256) else 0
        best = max(best, run)
    return best


@SETTINGS
@given(data=st.data(), skip=st.booleans(), strip=st.booleans())
def test_byte_fallback_streams_equal_full_decode(spm, data, skip, strip):
    """With byte fallback (invalid bytes turn a whole run of byte tokens into U+FFFD), the streamed text is the
    decode of the generated ids after the prompt's context, however the ids are grouped."""
    tok = spm[0 if strip else 1]
    prompt, ids = data.draw(spm_ids()), data.draw(spm_ids())
    assume(longest_byte_run(ids) <= MAX_HELD_RUN_IDS)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    context = list(detok._ids)  # the prompt ids it decodes the output after (none when they end in bytes)
    full, head = decode(tok, context + ids, skip), decode(tok, context, skip)
    assert full.startswith(head)
    assert stream(detok, data.draw(grouped(ids))) == (full[len(head):], None)
    if not context:
        assert detok.text == decode(tok, ids, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_a_stray_byte_after_a_character_of_byte_tokens(spm, skip):
    """"你" as three byte tokens then a stray continuation byte: a full decode shows four U+FFFD (the
    ByteFallback decoder's whole-run rule), and so does the stream, one id at a time."""
    tok = spm[0]
    ids = [byte_id(b) for b in "你".encode()] + [byte_id(0x80)]
    assert decode(tok, ids, skip) == "\ufffd" * 4
    assert stream(IncrementalDetokenizer(tok, [], skip_special_tokens=skip), [[i] for i in ids]) == ("\ufffd" * 4, None)
    # a skipped special token does not end the run; a shown one does
    ids = ids[:3] + [1] + ids[3:]
    want = "\ufffd" * 4 if skip else "你<s>\ufffd"
    assert decode(tok, ids, skip) == want
    assert stream(IncrementalDetokenizer(tok, [], skip_special_tokens=skip), [[i] for i in ids]) == (want, None)


def test_a_prompt_ending_in_byte_tokens_is_not_merged_with_the_output(spm):
    """A prompt ending in a character spelled in bytes: a first generated stray byte is one U+FFFD, as in the
    decode of the generated ids, not a run that turns the prompt's character into U+FFFD too."""
    tok = spm[0]
    prompt = tok.encode("hello", add_special_tokens=False) + [byte_id(b) for b in "你".encode()]
    assert stream(IncrementalDetokenizer(tok, prompt), [[byte_id(0x80)]]) == ("\ufffd", None)


@SETTINGS
@given(data=st.data(), skip=st.booleans(), include=st.booleans(), strip=st.booleans())
def test_byte_fallback_stop_strings_cut_where_a_one_shot_search_does(spm, data, skip, include, strip):
    """Stop strings (several, overlapping, spanning tokens, one a prefix of another) cut the streamed text where
    searching the one-shot decode does, however the ids are grouped."""
    tok = spm[0 if strip else 1]
    ids = data.draw(spm_ids())
    assume(longest_byte_run(ids) <= MAX_HELD_RUN_IDS)
    full = decode(tok, ids, skip)
    spans = data.draw(st.lists(st.tuples(st.integers(0, len(full)), st.integers(1, 5)), max_size=3))
    stop = [full[a:a + n] for a, n in spans if full[a:a + n]]
    stop += [s[:-1] for s in stop if len(s) > 1] + data.draw(st.lists(st.sampled_from(["o", "你", "<s>", " "]),
                                                                       max_size=2))
    detok = IncrementalDetokenizer(tok, [], stop=stop, skip_special_tokens=skip, include_stop_str_in_output=include)
    assert stream(detok, data.draw(grouped(ids))) == reference_stop(full, stop, include)


def test_min_new_tokens_text_does_not_wait_for_a_split_character(bbpe):
    """Text of an id before min_new_tokens is never matched, even when its push also holds the first bytes of
    a split character (its text then waited, and was matched at the id that reaches min_new_tokens)."""
    tok, _ = bbpe
    ids = tok.encode("a你", add_special_tokens=False)
    assert len(ids) == 3 and decode(tok, ids[:2], True).endswith("\ufffd")
    for pushes in ([[i] for i in ids], [ids[:2], ids[2:]], [ids]):
        assert stream(IncrementalDetokenizer(tok, [], stop=["a"], min_new_tokens=3), pushes) == ("a你", None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), on_spm=st.booleans(), end=st.booleans())
def test_grouping_does_not_change_stops_with_min_new_tokens(spm, bbpe, data, on_spm, end):
    """With min_new_tokens and stop strings, any grouping of random ids gives the text and stop of one id at
    a time, the last id possibly ending the request."""
    if on_spm:
        tok, ids = spm[0], data.draw(spm_ids())
        assume(longest_byte_run(ids) <= MAX_HELD_RUN_IDS)
    else:
        tok, byte_ids = bbpe
        ids = data.draw(ids_strategy(len(tok), [0, 1, 2], byte_ids))
    assume(ids)
    stop = data.draw(st.lists(st.sampled_from(["a", "e", "你", " the", "\ufffd", "<|im_end|>", "<s>"]),
                              min_size=1, max_size=3))
    kw = dict(stop=stop, min_new_tokens=data.draw(st.integers(0, len(ids) + 1)), skip_special_tokens=data.draw(
        st.booleans()))
    one = stream(IncrementalDetokenizer(tok, [], **kw), [[i] for i in ids], end)
    assert stream(IncrementalDetokenizer(tok, [], **kw), data.draw(grouped(ids)), end) == one


@SETTINGS
@given(data=st.data(), finish=st.sampled_from(["length", "stop", "abort"]), include=st.booleans())
def test_request_state_chunks_stay_aligned(bbpe, data, finish, include):
    """Each chunk carries the one id its event sampled and that id's logprob; the chunks' text joins into the
    response's, which a one-shot decode then stop search gives; usage counts every id taken."""
    tok, byte_ids = bbpe
    ids = data.draw(ids_strategy(len(tok), [0, 1, 2], byte_ids))
    assume(ids)
    stop = tuple(s for s in data.draw(st.lists(st.sampled_from(["a", " the", "你", "\n", "e a"]), max_size=2)))
    params = SamplingParams.from_kwargs(max_new_tokens=len(ids), stop=stop, include_stop_str_in_output=include,
                                        logprobs=1)
    state = RequestState(tok, None, [5, 6], params, keep_logprobs=True)
    chunks = []
    for k, i in enumerate(ids):
        last = k == len(ids) - 1
        ev = NS(token_id=i, logprobs=Logprob(i, -k - 1.0, [(i, -k - 1.0)], 1), cached_tokens=0,
                finish_reason=finish if last and finish != "abort" else None, prompt_logprobs=None)
        chunks.append(state.on_event(ev))
        if state.finished:
            break
    if not state.finished:
        chunks.append(state.on_event(Ended("abort")))
    r = state.response()
    taken = ids[:len(r.token_ids)]
    assert r.token_ids == taken and [lp.token_id for lp in r.logprobs] == taken
    assert all(len(c.token_ids) <= 1 and len(c.logprobs or []) == len(c.token_ids) for c in chunks)
    assert [lp.logprob for c in chunks for lp in c.logprobs or []] == [-k - 1.0 for k in range(len(taken))]
    assert "".join(c.text for c in chunks) == r.generated_text
    assert [c.finish_reason is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage.completion_tokens == len(taken) and chunks[0].prompt_token_ids == [5, 6]
    text_ids = ids[:-1] if finish == "stop" and not include else ids
    full = decode(tok, text_ids, True)
    if finish == "length":      # cut by max_new_tokens inside a character: its bytes are left out, not U+FFFD
        speller = TokenSpeller(tok)
        special = {i for i, t in speller.added.items() if t.special}
        data = b"".join(speller.spell(i) for i in text_ids if i not in special)
        held = codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=False)   # holds back a tail
        if held != data.decode("utf-8", "replace"):
            full = full[:-1]
    want, hit = reference_stop(full, stop, include)
    assert r.generated_text == want
    if len(taken) < len(ids):  # a stop string ended it early: the engine must be told
        assert hit is not None and r.finish_reason == "stop" and state.needs_abort
    else:  # (an abort's flush may complete a stop string: the text is cut, the reason stays "abort")
        assert r.finish_reason in ({"stop", finish} if hit else {finish})
        assert not state.needs_abort or (hit and finish == "abort")
