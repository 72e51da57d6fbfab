"""The text around the id that ends a request (EOS or a stop id), and stop strings with min_new_tokens
whatever the pushes' batching: vLLM's rules, on the default model's byte-level BPE tokenizer."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import transformers

from mii_async.text.detokenizer import Delta, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], stop_terminated: bool) -> str:
    """Pushes ids one at a time, the last with `stop_terminated`, then flushes (as RequestState does)."""
    out = "".join(detok.push([i]).text for i in ids[:-1])
    delta = detok.push(ids[-1:], stop_terminated=stop_terminated)
    return out + delta.text + ("" if delta.stopped else detok.flush())


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_id_that_ends_a_request_is_left_out_of_the_text(tok, include):
    """A stop id with text of its own ("." here) ends the request without its text, unless
    include_stop_str_in_output, as vLLM; the id still counts as generated."""
    ids = encode(tok, " Paris.")
    detok = IncrementalDetokenizer(tok, encode(tok, "The capital of France is"), include_stop_str_in_output=include)
    assert stream(detok, ids, stop_terminated=True) == (" Paris." if include else " Paris")
    assert detok.text == (" Paris." if include else " Paris")


def test_eos_text_is_left_out_even_when_special_tokens_are_shown(tok):
    """With skip_special_tokens=False, the EOS that ended the request is not part of the text (vLLM), while
    special tokens generated before it are."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = [start, *encode(tok, "Hi!"), eos]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert stream(detok, ids, stop_terminated=True) == "<|im_start|>Hi!"


def test_a_character_split_before_the_stop_id_is_still_completed(tok):
    """Ids held back for a split character are decoded at the end as in a full decode, the stop id left out."""
    ids = encode(tok, "你好") + encode(tok, ".")
    detok = IncrementalDetokenizer(tok, [])
    assert stream(detok, ids, stop_terminated=True) == "你好"
    # stop_terminated=False (ended by length) keeps every id's text
    assert stream(IncrementalDetokenizer(tok, []), ids, stop_terminated=False) == "你好."


def test_stop_strings_and_min_new_tokens_do_not_depend_on_batching(tok):
    """A stop string whose text comes wholly from ids before min_new_tokens is not matched, whether those ids
    arrive one at a time or in one push with the id that reaches the threshold."""
    ids = encode(tok, "STOP then more words STOP end")
    n_first = next(n for n in range(1, len(ids) + 1) if tok.decode(ids[:n]).endswith("STOP"))
    for min_new in (n_first + 1, n_first + 2):
        one = IncrementalDetokenizer(tok, [], stop=["STOP"], min_new_tokens=min_new)
        deltas = []
        for i in ids:
            deltas.append(one.push([i]))
            if deltas[-1].stopped:
                break
        by_one = "".join(d.text for d in deltas)
        batched = IncrementalDetokenizer(tok, [], stop=["STOP"], min_new_tokens=min_new)
        d = batched.push(ids)
        assert by_one == "STOP then more words " and d == Delta(by_one, True, "STOP"), min_new
        # the push ends with the id that reaches the threshold
        edge = IncrementalDetokenizer(tok, [], stop=["STOP"], min_new_tokens=min_new)
        assert not edge.push(ids[:min_new]).stopped and edge.text + edge.flush() == tok.decode(ids[:min_new])


PIECES = [*"abc .,\n", *"你好", "🎉", "é", " the", "User:", "STOP"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.sampled_from(PIECES), max_size=25).map("".join), data=st.data())
def test_batched_pushes_equal_one_by_one_with_min_new_tokens(tok, text, data):
    """With stop strings and min_new_tokens, any cutting of the ids into pushes gives the text and stop of
    one id at a time, the last id possibly ending the request."""
    ids = encode(tok, text)
    if not ids:
        return
    stop = data.draw(st.lists(st.sampled_from(["STOP", "User:", "a", "好", " the", "\n\n"]), min_size=1, max_size=3))
    min_new = data.draw(st.integers(0, len(ids) + 1))
    end = data.draw(st.booleans())
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids)), max_size=len(ids))) | {len(ids)})
    chunks = [ids[a:b] for a, b in zip([0, *cuts], cuts) if b > a]
    results = []
    for pushes in ([[i] for i in ids], chunks):
        detok = IncrementalDetokenizer(tok, [], stop=stop, min_new_tokens=min_new)
        out, stopped = "", None
        for k, chunk in enumerate(pushes):
            d = detok.push(chunk, stop_terminated=end and k == len(pushes) - 1)
            out += d.text
            if d.stopped:
                stopped = d.stop_str
                break
        else:
            out += detok.flush()
            stopped = detok.stop_str                  # (a stop string the held text completes)
        results.append((out, stopped))
    assert results[0] == results[1]
