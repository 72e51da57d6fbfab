"""Every sampling and engine option is validated, and the error names the parameter."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from mii_async.config import EngineConfig
from mii_async.errors import InvalidParameterError
from mii_async.params import SamplingParams

BAD_SAMPLING = [
    ("max_new_tokens", -1), ("max_new_tokens", 0), ("max_new_tokens", 1.5), ("max_new_tokens", True),
    ("min_new_tokens", -2), ("temperature", math.nan), ("temperature", -0.1), ("temperature", math.inf),
    ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -5),
    ("min_p", 1.2), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("seed", -1), ("seed", "x"), ("stop", [""]), ("stop", [1, 2]), ("stop", ["x"] * 17),
    ("stop_token_ids", [-1]), ("stop_token_ids", "2"), ("logprobs", 21), ("logprobs", -1),
    ("ignore_eos", "yes"), ("do_sample", 1),
]


@pytest.mark.parametrize("name,value", BAD_SAMPLING)
def test_bad_sampling_value_names_the_parameter(name, value):
    """A bad value raises InvalidParameterError whose .param and message name the field."""
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_kwargs(**{name: value})
    assert info.value.param == name and name in str(info.value)


INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "return_full_text", "do_sample")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@pytest.mark.parametrize("name,value", [(n, v) for n in INT_FIELDS for v in ("5", True, False, 5.0, [5])]
                         + [(n, v) for n in BOOL_FIELDS for v in ("true", 1, 0, [True])]
                         + [(n, v) for n in FLOAT_FIELDS for v in ("0.5", True)]
                         + [("stop_token_ids", [True]), ("stop_token_ids", ["5"])])
def test_types_are_strict(name, value):
    """No coercion: a string, a boolean or a float for an integer, a number for a boolean, a string or a
    boolean for a float is refused by name — what JSON callers (REST, WebSocket frames) send is taken as is."""
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams.from_kwargs(**{name: value})
    assert info.value.param == name


def test_strict_types_accept_their_own():
    p = SamplingParams.from_kwargs(max_new_tokens=5, min_new_tokens=1, top_k=3, seed=7, logprobs=2,
                                   prompt_logprobs=0, ignore_eos=True, do_sample=False, temperature=1)
    assert (p.max_new_tokens, p.top_k, p.seed, p.logprobs, p.prompt_logprobs, p.ignore_eos) == (5, 3, 7, 2, 0, True)
    assert p.temperature == 1.0 and isinstance(p.temperature, float)


def test_min_above_max_is_rejected():
    """min_new_tokens above max_new_tokens is an error naming min_new_tokens."""
    with pytest.raises(InvalidParameterError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


def test_unknown_keys_are_rejected():
    """An unknown sampling key or engine option is an error naming it."""
    with pytest.raises(InvalidParameterError, match="max_tokenz"):
        SamplingParams.from_kwargs(max_tokenz=3)
    with pytest.raises(InvalidParameterError, match="kv_blocks"):
        EngineConfig.from_kwargs(None, kv_blocks=3)


@pytest.mark.parametrize("name,value", [("dtype", "int3"), ("device", "tpu"), ("block_size", 12),
                                        ("num_blocks", 0), ("max_batch_tokens", -1), ("max_num_seqs", 0),
                                        ("kv_cache_memory", 0), ("max_model_len", 0),
                                        ("max_mixed_batch_tokens", 0), ("step_token_multiple", 0),
                                        ("step_token_multiple", 2.5), ("cuda_graphs", "yes"),
                                        ("piecewise_graphs", 1)])
def test_bad_engine_option_names_it(name, value):
    """Bad engine options raise InvalidParameterError naming the option."""
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig.from_kwargs(None, **{name: value})
    assert info.value.param == name


def test_mixed_budget_defaults():
    """The mixed budget: 1536 on a GPU, none of its own on CPU, never above max_batch_tokens."""
    from mii_async.config import SchedulerConfig
    assert SchedulerConfig().resolved("cuda").max_mixed_batch_tokens == 1536
    assert SchedulerConfig().resolved("cpu").max_mixed_batch_tokens == 256
    assert SchedulerConfig(max_batch_tokens=1024).resolved("cuda").max_mixed_batch_tokens == 1024
    assert SchedulerConfig(max_batch_tokens=4096).resolved("cpu").max_mixed_batch_tokens == 256
    assert SchedulerConfig(max_batch_tokens=128).resolved("cpu").max_mixed_batch_tokens == 128
    assert SchedulerConfig(max_mixed_batch_tokens=256).resolved("cuda").max_mixed_batch_tokens == 256
    assert SchedulerConfig().resolved("cuda").step_token_multiple == 64            # the piecewise buckets' step
    assert SchedulerConfig().resolved("cpu").step_token_multiple is None
    assert SchedulerConfig(step_token_multiple=1).resolved("cuda").step_token_multiple == 1   # 1: not cut
    assert SchedulerConfig(step_token_multiple=128).resolved("cpu").step_token_multiple == 128


def test_running_sequences_fit_one_step():
    """A step decodes every running sequence: max_num_seqs above max_batch_tokens is refused, naming the budget,
    and a default max_num_seqs comes down to a small budget."""
    from mii_async.config import SchedulerConfig
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig.from_kwargs(None, max_batch_tokens=16, max_num_seqs=64)
    assert info.value.param == "max_batch_tokens" and "max_num_seqs (64)" in str(info.value)
    assert SchedulerConfig(max_batch_tokens=16).resolved("cpu").max_num_seqs == 16
    assert SchedulerConfig(max_batch_tokens=100).resolved("cuda").max_num_seqs == 100
    assert SchedulerConfig(max_batch_tokens=64, max_num_seqs=64).resolved("cpu").max_num_seqs == 64
    assert SchedulerConfig().resolved("cuda").max_num_seqs == 256
    assert SchedulerConfig(max_num_seqs=1024).resolved("cuda").max_num_seqs == 1024     # under the GPU's 2048
    with pytest.raises(InvalidParameterError) as info:                                # over the CPU's 512
        SchedulerConfig(max_num_seqs=1024).resolved("cpu")
    assert info.value.param == "max_num_seqs" and "(512 on cpu)" in str(info.value)


def test_normalisation():
    """A single stop string becomes a tuple, top_k=-1 means off, dtype aliases resolve."""
    p = SamplingParams(stop="\n", top_k=-1)
    assert p.stop == ("\n",) and p.top_k == 0 and p.greedy
    assert EngineConfig.from_kwargs(None, dtype="bf16").model.dtype == "bfloat16"


def test_import_is_light():
    """`import mii_async` loads neither torch nor cupy nor transformers nor outlines-core."""
    code = ("import sys, mii_async; print(sorted(m for m in ('torch', 'cupy', 'transformers', 'outlines_core') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_logit_bias_is_checked_and_normalized():
    """logit_bias takes {id: bias} (JSON's string keys too) or pairs, kept sorted; a bad key, a bias outside
    [-100, 100], a repeated id or too many entries is an error naming logit_bias; ids past the vocabulary too."""
    p = SamplingParams(logit_bias={"7": -100, 3: 2})
    assert p.logit_bias == ((3, 2.0), (7, -100.0))
    assert SamplingParams(**p.to_dict()).logit_bias == p.logit_bias        # as it travels
    for bad in ({"x": 1}, {"-1": 1}, {1: 101}, {1: float("nan")}, {1: True}, [(1, 2, 3)], 5, {1: 1, "1": 2},
                {i: 1 for i in range(1025)}):
        with pytest.raises(InvalidParameterError) as info:
            SamplingParams(logit_bias=bad)
        assert info.value.param == "logit_bias", bad
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(logit_bias={1: 10 ** 400})              # too large for a float: still named
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidParameterError, match="outside the vocabulary") as info:
        SamplingParams(logit_bias={50: 1}).check_vocab(50)
    assert info.value.param == "logit_bias"


def test_guided_params_are_checked_and_normalized():
    """guided_json takes a schema (dict or JSON text, kept as compact text), guided_choice a list of strings,
    guided_regex a regex; at most one of them; a schema the compiler refuses, a bad regex or an empty choice
    is an error naming the field."""
    p = SamplingParams(guided_json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    assert p.guided_json == '{"type":"object","properties":{"b":{"type":"integer"},"a":{}}}'   # order kept
    assert p.guide == ("guided_json", p.guided_json) and SamplingParams(**p.to_dict()).guide == p.guide
    assert SamplingParams(guided_choice=["a", "b"]).guide == ("guided_choice", ("a", "b"))
    assert SamplingParams().guide is None
    for name, bad in [("guided_json", {"type": "wat"}), ("guided_json", "not json"), ("guided_json", [1]),
                      ("guided_regex", "(("), ("guided_regex", ""), ("guided_choice", []), ("guided_choice", ["a", 1]),
                      ("guided_regex", "a\ud800"), ("guided_choice", ["\udfff"]), ("guided_json", {"a\ud800": 1})]:
        with pytest.raises(InvalidParameterError) as info:
            SamplingParams(**{name: bad})
        assert info.value.param == name, (name, bad)
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(guided_json={"type": "object"}, guided_choice=["a"])
    assert info.value.param == "guided_choice"


def test_do_sample_alone_samples_at_temperature_one():
    """do_sample=True without a temperature samples at temperature 1, as transformers' generate and
    DeepSpeed-MII do (it was greedy: temperature defaulted to 0); an explicit temperature wins, do_sample=False
    forces greedy, and with neither the default stays greedy. The resolved value travels as it is."""
    p = SamplingParams(do_sample=True)
    assert p.temperature == 1.0 and not p.greedy
    assert SamplingParams(**p.to_dict()) == p
    assert SamplingParams(do_sample=True, temperature=0.5).temperature == 0.5
    assert SamplingParams(do_sample=True, temperature=0.0).greedy
    assert SamplingParams(do_sample=False, temperature=0.8).greedy
    assert SamplingParams().temperature == 0.0 and SamplingParams().greedy
    assert SamplingParams(temperature=None).greedy             # JSON's null: not given
    assert SamplingParams.from_kwargs(do_sample=True, temperature=None).temperature == 1.0
