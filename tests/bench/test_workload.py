"""Benchmark workloads: seeded random ids, ShareGPT files and prompt files, with clear errors."""
from __future__ import annotations

import json

import pytest

from mii_async.bench.workload import prompts_file_requests, random_requests, sharegpt_requests
from mii_async.errors import InvalidParameterError


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def test_random_lengths_prefix_and_no_special_ids():
    """Lengths fall in their ranges, every prompt starts with the shared prefix, no special id is drawn."""
    reqs = random_requests(200, (10, 20), (3, 7), prefix_len=6, seed=3, vocab_size=50, special_ids=[0, 1, 2])
    assert reqs == random_requests(200, (10, 20), (3, 7), prefix_len=6, seed=3, vocab_size=50, special_ids=[0, 1, 2])
    prefix = reqs[0].prompt[:6]
    for r in reqs:
        assert 10 <= r.prompt_len == len(r.prompt) <= 20 and 3 <= r.output_len <= 7
        assert r.prompt[:6] == prefix and not {0, 1, 2} & set(r.prompt)
    assert {r.prompt_len for r in reqs} == set(range(10, 21))


def test_random_bad_values_name_the_parameter():
    for kwargs, param in ((dict(n=0), "num_prompts"), (dict(input_len=(5, 2)), "input_len"),
                          (dict(output_len=(0, 3)), "output_len"), (dict(prefix_len=10), "prefix_len")):
        args = dict(n=4, input_len=(10, 20), output_len=(1, 4), vocab_size=50) | kwargs
        with pytest.raises(InvalidParameterError, match=param):
            random_requests(args.pop("n"), args.pop("input_len"), args.pop("output_len"), **args)


def test_sharegpt_first_turn_and_reply_length(tmp_path, tokenizer):
    convs = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i} in some detail please"},
                                {"from": "gpt", "value": "It is a number that comes after the one before it."}]}
             for i in range(10)] + [{"conversations": [{"from": "human", "value": "hi"}]}, {"id": "no turns"}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_requests(str(path), 5, tokenizer, seed=1)
    reply_len = len(tokenizer(convs[0]["conversations"][1]["value"]).input_ids)
    assert len(reqs) == 5 and all(r.output_len == reply_len for r in reqs)
    assert all(r.prompt.startswith("Tell me") and r.prompt_len == len(tokenizer(r.prompt).input_ids) for r in reqs)
    assert all(r.output_len == 9 for r in sharegpt_requests(str(path), 5, tokenizer, output_len=9))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(InvalidParameterError, match="dataset_path.*no conversation"):
        sharegpt_requests(str(tmp_path / "empty.json"), 5, tokenizer)
    with pytest.raises(InvalidParameterError, match="dataset_path.*cannot read"):
        sharegpt_requests(str(tmp_path / "missing.json"), 5, tokenizer)


def test_prompts_files_text_and_jsonl(tmp_path, tokenizer):
    (tmp_path / "p.txt").write_text("The capital of France is\n\nOne two three\n")
    reqs = prompts_file_requests(str(tmp_path / "p.txt"), None, tokenizer, 12)
    assert [r.prompt for r in reqs] == ["The capital of France is", "One two three"]
    assert all(r.output_len == 12 for r in reqs)
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hello", "output_len": 3}\n{"prompt": "World"}\n')
    assert [r.output_len for r in prompts_file_requests(str(tmp_path / "p.jsonl"), None, tokenizer, 5)] == [3, 5]
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(InvalidParameterError, match="holds no prompt"):
        prompts_file_requests(str(tmp_path / "blank.txt"), None, tokenizer, 5)
