"""Guided generation on the default model (a ByteLevel vocabulary): the vocabulary's bytes, the masks, and the
engine's outputs, which must match their guide whatever the sampling; requests held while their automaton
compiles can be aborted; a guide that cannot be compiled fails its request alone."""
from __future__ import annotations

import json
import re

import pytest
import torch

from mii_async.params import SamplingParams

from .helpers import make_engine

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"}, "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"]}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return make_engine(default_model_dir, kv_cache_memory=0.1)


def _run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[int, tuple[list[int], str]]:
    base = 70_000 + engine.num_steps * 100
    outs: dict[int, list[int]] = {base + i: [] for i in range(len(prompts))}
    reasons: dict[int, str] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(base + i, p, sp)
    while engine.has_work():
        for o in engine.step():
            outs[o.req_id].append(o.token_id)
            if o.finish_reason:
                reasons[o.req_id] = o.finish_reason
    assert engine.take_failed() == []
    return {i - base: (outs[i], reasons[i]) for i in outs}


def _chat(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_token_bytes_spell_every_text(tokenizer):
    """The bytes given to each token concatenate, over any encoding, to the text's UTF-8 bytes."""
    from mii_async.workers.guides import token_bytes

    by_id = {i: b for b, ids in token_bytes(tokenizer).items() for i in ids}
    assert len(by_id) >= len(tokenizer) - len(tokenizer.all_special_ids) - 1
    for text in ["Hello, world!", "  two spaces\nand a newline\t", "naïve café — 東京 🙂", '{"a": [1, 2.5e-3]}']:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(by_id[i] for i in ids) == text.encode("utf-8")


def test_masks_equal_the_guides_allowed_tokens(engine):
    """The bool mask of a guide's state holds exactly the ids outlines-core allows there."""
    from outlines_core import Guide

    from mii_async.workers.guides import GuideCompiler, guide_masks

    compiler = GuideCompiler(engine.model_path, engine.spec.eos_token_ids)
    idx = compiler.index(("guided_json", json.dumps(SCHEMA))).result()
    g = Guide(idx)
    for _ in range(6):
        allowed = g.get_tokens()
        mask = guide_masks([g], engine.spec.vocab_size, torch.device("cpu"))
        assert mask.shape == (1, engine.spec.vocab_size)
        assert set(mask[0].nonzero().flatten().tolist()) == set(allowed)
        g.advance(allowed[-1], return_tokens=False)


def test_outputs_match_their_guides(engine, tokenizer):
    """JSON schema, JSON mode, regex and choice, greedy and sampled, in one batch with an unguided request:
    each guided output matches its guide and ends with "stop"; the unguided one runs to its length."""
    prompt = _chat(tokenizer, "Describe Paris as JSON.")
    params = [SamplingParams(max_new_tokens=80, guided_json=SCHEMA),
              SamplingParams(max_new_tokens=80, guided_json=SCHEMA, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=12, guided_regex=r"[0-9]{3}-[A-Z]{2}"),
              SamplingParams(max_new_tokens=12, guided_choice=["yes", "no", "maybe not"], temperature=1.0, seed=1),
              SamplingParams(max_new_tokens=10, min_new_tokens=10)]
    outs = _run(engine, [prompt] * len(params), params)
    for i in (0, 1):
        ids, reason = outs[i]
        doc = json.loads(tokenizer.decode(ids, skip_special_tokens=True))
        assert reason == "stop" and set(doc) == {"city", "population", "capital"}, doc
        assert isinstance(doc["city"], str) and len(doc["city"]) <= 20
        assert isinstance(doc["population"], int) and isinstance(doc["capital"], bool)
    ids, reason = outs[2]
    assert reason == "stop" and re.fullmatch(r"[0-9]{3}-[A-Z]{2}", tokenizer.decode(ids, skip_special_tokens=True))
    ids, reason = outs[3]
    assert reason == "stop" and tokenizer.decode(ids, skip_special_tokens=True) in ("yes", "no", "maybe not")
    assert outs[4][1] == "length" and len(outs[4][0]) == 10


def test_json_mode_and_async_scheduling(default_model_dir, tokenizer):
    """JSON mode ({"type": "object"}) under async scheduling gives the synchronous engine's output, a JSON
    object; every KV block is back at the end."""
    prompt = _chat(tokenizer, "Give me a JSON object about cats.")
    texts = []
    for mode in (False, True):
        eng = make_engine(default_model_dir, kv_cache_memory=0.05, async_scheduling=mode)
        [(ids, reason)] = _run(eng, [prompt], [SamplingParams(max_new_tokens=60, guided_json={"type": "object"})]
                               ).values()
        texts.append((tokenizer.decode(ids, skip_special_tokens=True), reason))
        assert eng.block_manager.num_free == eng.num_blocks
    assert texts[0] == texts[1]
    text, reason = texts[0]
    assert reason == "length" or isinstance(json.loads(text), dict), texts


def test_abort_while_compiling_and_a_guide_that_cannot_compile(engine):
    """A request aborted while its automaton compiles leaves nothing behind; a regex outlines-core refuses
    (a lookahead) fails that request alone, reported by take_failed, while another request finishes."""
    engine.add_request(1, [1, 2, 3], SamplingParams(max_new_tokens=4, guided_regex="x{1,3}(ab|cd)*y{2,9}z"))
    assert engine.abort(1) and not engine.has_work() and 1 not in engine.seqs
    engine.add_request(2, [1, 2, 3], SamplingParams(max_new_tokens=4, guided_regex="a(?=b)"))
    engine.add_request(3, [1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
    done = {}
    failed = []
    while engine.has_work():
        for o in engine.step():
            done.setdefault(o.req_id, []).append(o.token_id)
        failed += engine.take_failed()
    assert [r for r, _ in failed] == [2] and "cannot be compiled" in failed[0][1]
    assert len(done[3]) == 4 and 2 not in done and not engine.seqs
    assert engine.block_manager.num_free == engine.num_blocks


def test_token_bytes_of_a_sentencepiece_vocabulary():
    """A Llama-2-style vocabulary (Metaspace, byte fallback): ▁ is a space and <0xHH> a raw byte, so the tokens
    of any text spell its bytes (after the ▁ that Metaspace puts before the first word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mii_async.workers.guides import token_bytes

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(["the cat sat on the mat", "a naive café in Paris", "hello world"] * 20,
                                trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    vocab = {**trained.get_vocab(), **{f"<0x{b:02X}>": 1000 + b for b in range(256)}}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(trained.to_str())["model"]["merges"]]
    sp = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    by_id = {i: b for b, ids in token_bytes(tok).items() for i in ids}
    for text in ["the cat sat", "naive café", "東京 🙂 x"]:
        ids = tok.encode(text, add_special_tokens=False)
        if text.startswith("東"):
            assert any(i >= 1000 for i in ids)               # the byte fallback was used
        assert b"".join(by_id[i] for i in ids) == b" " + text.encode("utf-8"), (text, ids)
