"""JSON schemas whose constraints outlines-core's compiler leaves out or gets wrong (mii_async/guided.py puts them
right): the regex of a schema admits exactly the texts the schema does, for numeric bounds (pydantic's ge / le
/ gt / lt, PositiveInt, draft 4's boolean exclusives), formats date and time, a pattern's ASCII \\d and
\\w, property names JSON escapes; and the engine's outputs under such a schema validate, greedy and sampled."""
from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest

from mii_async.errors import InvalidParameterError
from mii_async.guided import schema_regex
from mii_async.params import SamplingParams

_NUMBERS = sorted({str(i) for i in range(-130, 131)} | {f"{i}.{f}" for i in range(-12, 13)
                                                         for f in ("0", "5", "05", "50", "25", "125", "9", "0001")}
                  | {"1000", "-1000", "12345", "100.5", "-0", "-0.0"})


def _admits(schema: dict, text: str) -> bool:
    return re.fullmatch(schema_regex(json.dumps(schema)), text) is not None


def _within(v: Decimal, schema: dict) -> bool:
    b = {k: Decimal(repr(schema[k])) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
         if k in schema and not isinstance(schema[k], bool)}
    lo_strict = schema.get("exclusiveMinimum") is True
    hi_strict = schema.get("exclusiveMaximum") is True
    return (("minimum" not in b or (v > b["minimum"] if lo_strict else v >= b["minimum"]))
            and ("maximum" not in b or (v < b["maximum"] if hi_strict else v <= b["maximum"]))
            and ("exclusiveMinimum" not in b or v > b["exclusiveMinimum"])
            and ("exclusiveMaximum" not in b or v < b["exclusiveMaximum"]))


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 1, "maximum": 5},
    {"type": "integer", "exclusiveMinimum": 0},                         # pydantic's PositiveInt
    {"type": "integer", "minimum": -17, "exclusiveMaximum": 101},
    {"type": "integer", "maximum": -3},
    {"type": "integer", "minimum": 2.5, "maximum": 7.5},
    {"type": "number", "minimum": 0, "maximum": 1},                     # Field(ge=0, le=1): a confidence
    {"type": "number", "exclusiveMinimum": -2.25, "exclusiveMaximum": 7.05},
    {"type": "number", "minimum": 0.125},
    {"type": "number", "maximum": 0, "exclusiveMaximum": True},         # draft 4
    {"type": "number", "minimum": -1000, "maximum": 100.5},
])
def test_numbers_within_their_bounds_and_no_others(schema):
    """Every JSON number of the samples is admitted exactly when it lies within the bounds (-0 either way)."""
    for text in _NUMBERS:
        if schema["type"] == "integer" and "." in text or text in ("-0", "-0.0"):
            continue
        assert _admits(schema, text) == _within(Decimal(text), schema), (schema, text)


def test_bounds_inside_objects_arrays_unions_and_refs():
    """Bounds are kept wherever the numeric schema sits: a property, an array's items, [integer, null], $defs."""
    schema = {"$defs": {"pct": {"type": "number", "minimum": 0, "maximum": 100}},
              "type": "object", "properties": {
                  "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 3},
                  "xs": {"type": "array", "items": {"type": "integer", "exclusiveMinimum": 0}, "maxItems": 3},
                  "p": {"$ref": "#/$defs/pct"}, "k": {"enum": [7, 700]}},
              "required": ["n", "xs", "p", "k"]}
    assert _admits(schema, '{"n":2,"xs":[1,20],"p":99.5,"k":700}')
    assert _admits(schema, '{"n":null,"xs":[],"p":0,"k":7}')
    named = {"type": "object", "properties": {"default": {"type": "integer", "maximum": 0}}, "required": ["default"]}
    assert _admits(named, '{"default":0}') and not _admits(named, '{"default":1}')    # a property, not a value
    for bad in ('{"n":4,"xs":[1],"p":1,"k":7}', '{"n":2,"xs":[0],"p":1,"k":7}', '{"n":2,"xs":[1],"p":100.5,"k":7}',
                '{"n":2,"xs":[1],"p":-1,"k":7}'):
        assert not _admits(schema, bad), bad


def test_a_pydantic_model_with_field_bounds():
    """The schema the openai package sends for a pydantic model (chat.completions.parse) keeps ge / le / gt."""
    pydantic = pytest.importorskip("pydantic")
    to_strict = pytest.importorskip("openai.lib._pydantic").to_strict_json_schema

    class City(pydantic.BaseModel):
        population: int = pydantic.Field(ge=0, le=100)
        score: float = pydantic.Field(gt=0, lt=1)

    schema = to_strict(City)
    assert _admits(schema, '{"population":100,"score":0.5}')
    assert not _admits(schema, '{"population":123,"score":0.5}')
    assert not _admits(schema, '{"population":1,"score":1}')


def test_bounds_no_integer_meets_are_the_callers_error():
    with pytest.raises(InvalidParameterError, match="guided_json"):
        SamplingParams(guided_json={"type": "integer", "minimum": 1.2, "maximum": 1.8})


def test_formats_and_patterns_are_json_schemas():
    """format time admits no backslash (outlines-core writes `\\\\.`), format date and a pattern's \\d no
    digits but 0-9, \\w no letters but ASCII ones (JSON Schema's patterns are ECMA-262's)."""
    time, date = {"type": "string", "format": "time"}, {"type": "string", "format": "date"}
    assert _admits(time, '"12:30:59"') and _admits(time, '"12:30:59.5Z"') and _admits(time, '"01:00:00+02:00"')
    assert not _admits(time, '"12:30:59\\q5"') and not _admits(time, '"12:30:59\\"5"')
    assert _admits(date, '"2024-02-29"') and not _admits(date, '"\U0001FBF2024-02-29"')
    stamp = {"type": "string", "format": "date-time"}
    assert _admits(stamp, '"2024-02-29T12:00:00Z"') and _admits(stamp, '"2024-02-29T12:00:00.25+05:30"')
    assert not _admits(stamp, '"202402291234-02-29T12:00:00Z"')      # a year pydantic's datetime refuses
    pattern = {"type": "string", "pattern": "^\\d{2}-\\w+$"}
    assert _admits(pattern, '"12-ab_C"')
    assert not _admits(pattern, '"١٢-ab"') and not _admits(pattern, '"12-é"')
    literal = {"const": "a\\d"}                      # a backslash in a value is not a class
    assert _admits(literal, '"a\\\\d"')


def test_property_names_json_escapes_are_json():
    """A property name holding a quote, a backslash or a newline is written JSON-escaped (outlines-core wrote it
    raw: invalid JSON), required or not; other names as before."""
    names = ['a"b', "back\\slash", "two\nlines", "plain", "a.b"]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names[:3]}
    text = json.dumps({n: 1 for n in names}, separators=(",", ":"), ensure_ascii=False)
    assert _admits(schema, text)
    assert not _admits(schema, text.replace('\\"', '"', 1))         # the raw quote: not JSON
    assert _admits({"type": "object", "properties": {"a.b": {"type": "integer"}}}, '{"a.b":1}')
    assert not _admits({"type": "object", "properties": {"a.b": {"type": "integer"}}}, '{"aXb":1}')


@pytest.fixture(scope="module")
def engine(default_model_dir):
    from ..helpers import make_engine

    eng = make_engine(default_model_dir, kv_cache_memory=0.1)
    yield eng
    eng.close()


def test_sampled_outputs_validate(engine, default_model_dir):
    """Greedy and sampled (three seeds) outputs under bounded numbers end with "stop" inside their bounds."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5},
                                               "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
              "required": ["n", "x"]}
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Give n=10 and x=23 as JSON."}],
                                                add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    params = [SamplingParams(max_new_tokens=40, guided_json=schema)] + \
        [SamplingParams(max_new_tokens=40, guided_json=schema, temperature=1.3, seed=s) for s in range(3)]
    outs: dict[int, list[int]] = {i: [] for i in range(len(params))}
    reasons = {}
    for i, p in enumerate(params):
        engine.add_request(i, prompt, p)
    while engine.has_work():
        for o in engine.step():
            outs[o.req_id].append(o.token_id)
            if o.finish_reason:
                reasons[o.req_id] = o.finish_reason
    assert engine.take_failed() == []
    for i, ids in outs.items():
        doc = json.loads(tok.decode(ids, skip_special_tokens=True))
        assert reasons[i] == "stop" and 1 <= doc["n"] <= 5 and 0 < doc["x"] <= 1, doc
