"""Guided generation on the default model (a ByteLevel vocabulary): the vocabulary's bytes, the masks, and the
engine's outputs, which must match their guide whatever the sampling; requests held while their automaton
compiles can be aborted; a guide that cannot be compiled fails its request alone."""
from __future__ import annotations

import json
import re

import pytest
import torch

from mii_async.params import SamplingParams

from ..helpers import make_engine

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"}, "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"]}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def engine(default_model_dir):
    eng = make_engine(default_model_dir, kv_cache_memory=0.1)
    yield eng
    eng.close()


_LOGPROBS: dict[int, list] = {}


def _run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[int, tuple[list[int], str]]:
    _LOGPROBS.clear()
    base = 70_000 + engine.num_steps * 100
    outs: dict[int, list[int]] = {base + i: [] for i in range(len(prompts))}
    reasons: dict[int, str] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(base + i, p, sp)
    while engine.has_work():
        for o in engine.step():
            outs[o.req_id].append(o.token_id)
            if o.logprobs is not None:
                _LOGPROBS.setdefault(o.req_id - base, []).append(o.logprobs)
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
    from mii_async.text.token_bytes import token_bytes

    by_id = {i: b for b, ids in token_bytes(tokenizer).items() for i in ids}
    for text in ["Hello, world!", "  two spaces\nand a newline\t", "naïve café — 東京 🙂", '{"a": [1, 2.5e-3]}']:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(by_id[i] for i in ids) == text.encode("utf-8")


def test_special_tokens_are_never_in_a_guide(tokenizer):
    """Every added token marked special (<|im_end|>, <repo_name>, …) is left out of the guide's vocabulary."""
    from mii_async.text.token_bytes import token_bytes

    ids = {i for group in token_bytes(tokenizer).values() for i in group}
    special = {i for i, t in tokenizer.backend_tokenizer.get_added_tokens_decoder().items() if t.special}
    assert special and not ids & special and len(ids) == len(tokenizer) - len(special)


def test_masks_equal_the_guides_allowed_tokens(engine):
    """The bool mask of a guide's state holds exactly the ids outlines-core allows there, on the CPU path and
    through the device path's unpacking (run on the CPU), also when the words come from the cache."""
    from mii_async.workers.sampling.guide_compiler import GuideCompiler
    from mii_async.workers.sampling.guides import RequestGuide, guide_masks

    compiler = GuideCompiler(engine.model_path, engine.spec.eos_token_ids)
    try:
        g = RequestGuide(*compiler.index(("guided_json", json.dumps(SCHEMA))).result())
    finally:
        compiler.close()
    for _ in range(2):
        g2 = RequestGuide.__new__(RequestGuide)
        g2.guide, g2.key = g.guide, g.key
        for _ in range(6):
            allowed = g.guide.get_tokens()
            mask = guide_masks([g, g2], engine.spec.vocab_size, torch.device("cpu"))
            assert mask.shape == (2, engine.spec.vocab_size)
            assert set(mask[0].nonzero().flatten().tolist()) == set(allowed) == set(mask[1].nonzero().flatten().tolist())
            g.advance(allowed[-1])
        g.guide.reset()


def test_outputs_match_their_guides(engine, tokenizer):
    """JSON schema, JSON mode, regex and choice, greedy and sampled, in one batch with an unguided request:
    each guided output matches its guide and ends with "stop"; the unguided one runs to its length. Logprobs
    of a guided row are finite (masked tokens floored at -9999)."""
    prompt = _chat(tokenizer, "Describe Paris as JSON.")
    params = [SamplingParams(max_new_tokens=80, guided_json=SCHEMA, logprobs=5),
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
    assert all(-9999.0 <= v <= 0.0 for lp in _LOGPROBS[0] for _, v in lp.top) and _LOGPROBS[0]


def test_json_mode_ends_with_an_object(engine, tokenizer):
    """JSON mode ({"type": "object"}): the answer is one JSON object, ended by the model once it is closed."""
    prompt = _chat(tokenizer, "What is the capital of France? Answer in JSON.")
    [(ids, reason)] = _run(engine, [prompt], [SamplingParams(max_new_tokens=200, guided_json={"type": "object"})]
                           ).values()
    assert reason == "stop" and isinstance(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), dict)


def test_async_scheduling_and_preemption_give_the_same_outputs(default_model_dir, tokenizer):
    """Guided rows (one with a penalty) beside history-free unguided ones: async scheduling, and a pool so
    small that requests are preempted and recomputed, give the synchronous engine's outputs (a recompute must
    not walk a guide twice); every KV block comes back."""
    prompts = [_chat(tokenizer, q) for q in ("Describe Paris as JSON.", "Describe Rome as JSON.", "Hi!", "Count:")]
    params = [SamplingParams(max_new_tokens=60, guided_json=SCHEMA),
              SamplingParams(max_new_tokens=60, guided_json=SCHEMA, repetition_penalty=1.2),
              SamplingParams(max_new_tokens=24, min_new_tokens=24),
              SamplingParams(max_new_tokens=16, guided_regex=r"( [0-9]+,){3,8}")]
    runs = []
    for opts in ({"async_scheduling": False, "num_blocks": 256}, {"async_scheduling": True, "num_blocks": 256},
                 {"async_scheduling": True, "num_blocks": 8, "block_size": 16}):
        eng = make_engine(default_model_dir, **opts)
        try:
            # The guides compiled first, so that every request is scheduled from the first step on (a guided
            # request waits out its compile; the run would then depend on the compile's timing).
            for fut in [eng.guided_compiler().index(p.guide) for p in params if p.guide is not None]:
                fut.result(timeout=120)
            runs.append(_run(eng, prompts, params))
            assert eng.block_manager.num_free == eng.num_blocks
            if opts["num_blocks"] == 8:
                assert eng.scheduler.num_preemptions > 0
        finally:
            eng.close()
    assert runs[0] == runs[1] == runs[2]
    assert all(runs[0][i][1] == "stop" for i in (0, 1))


def test_abort_while_compiling_and_a_guide_that_cannot_compile(engine):
    """A request aborted after a step ran while its automaton still compiled leaves nothing behind; a regex
    outlines-core refuses (a lookahead) fails that request alone, reported by take_failed, while another
    request finishes."""
    engine.add_request(1, [1, 2, 3], SamplingParams(max_new_tokens=4, guided_regex="[a-z]{0,90}(ab|cd)*y{2,9}z"))
    engine.step()                                   # the compile takes longer than this step's wait
    assert 1 in engine.guided.pending
    assert engine.abort(1) and not engine.has_work() and 1 not in engine.seqs
    engine.add_request(2, [1, 2, 3], SamplingParams(max_new_tokens=4, guided_regex="a(?=b)"))
    engine.add_request(3, [1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
    done = {}
    failed = []
    while engine.has_work():
        for o in engine.step():
            done.setdefault(o.req_id, []).append(o.token_id)
        failed += engine.take_failed()
    assert [(r, p) for r, _, p in failed] == [(2, "guided_regex")] and "cannot be compiled" in failed[0][1]
    assert len(done[3]) == 4 and 2 not in done and not engine.seqs
    assert engine.block_manager.num_free == engine.num_blocks


def test_a_compile_past_its_limits_fails_only_its_request(default_model_dir):
    """A regex whose automaton outgrows the compiler's memory limit, and one past its deadline, fail their
    request with the reason; the compiler's process is replaced and the next guide compiles."""
    from mii_async.workers.sampling.guide_compiler import GuideCompiler

    compiler = GuideCompiler(default_model_dir, [2], memory_gib=1.0, timeout_s=60)
    try:
        with pytest.raises(Exception, match="GiB"):
            compiler.index(("guided_regex", "[^\\n]{0,3000}")).result(timeout=120)
        compiler.timeout_s = 0.5
        with pytest.raises(Exception, match="longer than 0.5 s"):
            compiler.index(("guided_regex", "[^\\n]{0,200}x")).result(timeout=120)
        compiler.timeout_s = 60
        index, _ = compiler.index(("guided_choice", ("yes", "no"))).result(timeout=120)
        assert index is not None
    finally:
        compiler.close()


def test_token_bytes_of_a_sentencepiece_vocabulary():
    """A Llama-2-style vocabulary (Metaspace, byte fallback): ▁ is a space and <0xHH> a raw byte, so the tokens
    of any text spell its bytes (after the ▁ that Metaspace puts before the first word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mii_async.text.token_bytes import token_bytes

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


def test_the_compiler_process_ends_with_its_replica(default_model_dir):
    """kill -9 of the process that started a guide compiler, in the middle of a compile: the compiler's
    process exits within seconds instead of being left behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import sys, time\nfrom mii_async.workers.sampling.guide_compiler import GuideCompiler\n"
            "c = GuideCompiler(sys.argv[1], [2], timeout_s=600)\n"
            "c.index(('guided_regex', '[^\\\\n]{0,1500}'))\ntime.sleep(1.0)\n"
            "while c._child is None:\n    time.sleep(0.1)\nprint(c._child.pid, flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, str(default_model_dir)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.kill(child, signal.SIGKILL)
        pytest.fail("the guide compiler outlived its replica")
    finally:
        parent.kill()


def test_masks_of_two_compilers_never_mix(default_model_dir):
    """Two compilers in one process (two engines): their automata's masks, cached in one table, stay apart."""
    from mii_async.workers.sampling.guide_compiler import GuideCompiler
    from mii_async.workers.sampling.guides import RequestGuide, guide_masks

    guides = []
    for regex in ("[0-9]+", "[a-z]+"):      # alike automata: the same state numbers, other tokens
        compiler = GuideCompiler(default_model_dir, [2])
        try:
            guides.append(RequestGuide(*compiler.index(("guided_regex", regex)).result(timeout=120)))
        finally:
            compiler.close()
    for g in guides + guides[::-1]:
        mask = guide_masks([g], 49152, torch.device("cpu"))
        assert set(mask[0].nonzero().flatten().tolist()) == set(g.guide.get_tokens())


def test_compiles_nobody_waits_for_are_skipped_and_close_is_final(default_model_dir):
    """Compiles run one at a time: one queued behind a slow compile whose requests all went away is skipped;
    Ctrl-C (SIGINT) to the compiler's process is not its to handle; after close() nothing compiles, queued or
    new."""
    import os
    import signal

    from mii_async.workers.sampling.guide_compiler import GuideCompiler

    compiler = GuideCompiler(default_model_dir, [2])
    try:
        slow = compiler.index(("guided_regex", "[a-z]{0,120}q"))
        unwanted = compiler.index(("guided_regex", "x[0-9]{2}"))
        compiler.release(unwanted)                              # its only request was aborted meanwhile
        with pytest.raises(Exception, match="no request waits"):
            unwanted.result(timeout=120)
        slow.result(timeout=120)
        os.kill(compiler._child.pid, signal.SIGINT)
        assert compiler.index(("guided_choice", ("a", "b"))).result(timeout=60)
        queued = compiler.index(("guided_regex", "[a-z]{0,150}w"))
        compiler.close()
        with pytest.raises(Exception, match="closing|exited"):
            queued.result(timeout=60)
        with pytest.raises(Exception, match="closing"):
            compiler.index(("guided_regex", "y+")).result(timeout=5)
        assert compiler._child is None or compiler._child.poll() is not None
    finally:
        compiler.close()
