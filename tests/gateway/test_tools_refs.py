"""tool_choice required with tools whose parameters hold local references ("$ref": "#/$defs/…", what
`openai.pydantic_function_tool` sends for a nested pydantic model, or "#" for a recursive one): the calls'
schema resolves them, and admits exactly the calls each tool's own schema admits."""
from __future__ import annotations

import json
import re

from mii_async.gateway.tool_mode import tool_mode
from mii_async.guided import schema_regex
from mii_async.params import SamplingParams

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "$defs": {"Point": POINT}, "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}},
    "required": ["to"], "additionalProperties": False}}}
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
    "required": ["kids"], "additionalProperties": False}}}
PLAIN = {"type": "function", "function": {"name": "plain", "parameters": {
    "$defs": {"Point": POINT}, "type": "object",
    "properties": {"q": {"enum": ["#/$defs/Point"]}, "const": {"$ref": "#/$defs/Point"}}, "required": ["q", "const"]}}}


def _admits(tools, text: str) -> bool:
    schema = tool_mode(tools, "required", None).guided_json()
    return re.fullmatch(schema_regex(SamplingParams(guided_json=schema).guided_json), text) is not None


def test_required_calls_of_tools_with_references():
    """A required call of a nested pydantic model's tool, or of a recursive one, is guided (no 400 naming
    tools) into its arguments' schema, references followed; values that look like references stay values."""
    tools = [MOVE, TREE, PLAIN]
    assert _admits(tools, '[{"name":"move","arguments":{"to":{"x":3}}}]')
    assert _admits(tools, '[{"name":"tree","arguments":{"kids":[{"kids":[]}]}},'
                          '{"name":"plain","arguments":{"q":"#/$defs/Point","const":{"x":0}}}]')
    assert not _admits(tools, '[{"name":"move","arguments":{"to":{"y":3}}}]')
    assert not _admits(tools, '[{"name":"move","arguments":{"to":3}}]')
    assert not _admits(tools, '[{"name":"tree","arguments":{"kids":[{"x":1}]}}]')


def test_a_pydantic_function_tool_can_be_required():
    """What the openai package sends for a pydantic model with a nested one works with tool_choice required,
    and named, and the tool's own schema is left as it was."""
    import openai
    import pydantic

    class Pt(pydantic.BaseModel):
        x: int

    class Move(pydantic.BaseModel):
        to: Pt

    tool = openai.pydantic_function_tool(Move)
    before = json.dumps(tool, sort_keys=True)
    assert _admits([tool], '[{"name":"Move","arguments":{"to":{"x":1}}}]')
    assert tool_mode([tool], {"type": "function", "function": {"name": "Move"}}, None).guided_json() == \
        tool["function"]["parameters"]
    assert json.dumps(tool, sort_keys=True) == before
