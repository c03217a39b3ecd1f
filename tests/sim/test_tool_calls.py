"""Hermes tool calls (`broker/tool_calls.py`): rendering, vLLM's parsing rules and its fallback,
call ids, and schema-valid arguments."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.tool_calls import (
    ParsedReply,
    ToolCallParsed,
    arguments_for,
    parse_tool_calls,
    render_tool_call,
    tool_call_id,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "detailed": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object"},
        "note": {"type": ["string", "null"]},
        "score": {"type": "number"},
    },
    "required": ["city", "days", "unit", "detailed", "hours", "where", "note", "score"],
}


def test_render_is_the_hermes_block_with_tojson_separators() -> None:
    text = render_tool_call("get_weather", {"city": "Zürich", "days": 2})
    assert text == ('<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Zürich", "days": 2}}\n</tool_call>')


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=8)


@given(st.text(max_size=20).filter(lambda t: "<tool_call>" not in t),
       st.lists(st.tuples(st.text(min_size=1, max_size=10),
                          st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
                min_size=1, max_size=3))
def test_rendered_calls_parse_back(prefix: str, calls: list[tuple[str, dict]]) -> None:
    text = prefix + "\n".join(render_tool_call(name, args) for name, args in calls)
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCallParsed(name, json.dumps(args, ensure_ascii=False))
                            for name, args in calls]
    assert parsed.content == (prefix or None)  # as vLLM's parser: not stripped


def test_text_without_a_call_is_all_content() -> None:
    assert parse_tool_calls("just words ") == ParsedReply(content="just words ", calls=[])
    assert parse_tool_calls("") == ParsedReply(content="", calls=[])


def test_an_unterminated_final_call_still_counts() -> None:
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"x": 1}}'
    assert parse_tool_calls(text) == ParsedReply("ok ", [ToolCallParsed("f", '{"x": 1}')])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # JSON cut short
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>oops</tool_call>',
    '<tool_call>\n{"name": "f"}\n</tool_call>',  # no arguments
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',  # a name that is no string
    '<tool_call>\n["f", {}]\n</tool_call>',  # not an object
    "<tool_call></tool_call>",  # empty
    'text <tool_call>\n{"name": "f", "argu',  # a reply cut by max_tokens
])
def test_any_bad_call_makes_the_whole_text_content_as_vllm_does(text: str) -> None:
    assert parse_tool_calls(text) == ParsedReply(content=text, calls=[])


def test_text_between_and_after_calls_is_dropped() -> None:
    text = (" hi \n" + render_tool_call("a", {}) + " between " + render_tool_call("b", {"k": "v"})
            + " after")
    parsed = parse_tool_calls(text)
    assert parsed.content == " hi \n"
    assert [c.name for c in parsed.calls] == ["a", "b"]
    assert parsed.calls[1].arguments == '{"k": "v"}'


def test_call_ids_look_like_vllms_and_differ() -> None:
    ids = {tool_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)


@given(st.integers(0, 2**63 - 1))
def test_arguments_are_valid_for_the_schema_and_repeat_for_a_seed(seed: int) -> None:
    args = arguments_for(WEATHER, random.Random(seed))
    jsonschema.validate(args, WEATHER)
    assert set(args) == set(WEATHER["required"])
    assert arguments_for(WEATHER, random.Random(seed)) == args
    assert re.fullmatch(r"[a-z]+( [a-z]+)*", args["city"])


def test_arguments_take_required_properties_else_all() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "required": ["b"]}
    assert list(arguments_for(schema, random.Random(1))) == ["b"]
    del schema["required"]
    assert list(arguments_for(schema, random.Random(1))) == ["a", "b"]
    assert arguments_for(None, random.Random(1)) == {}
    assert arguments_for({"type": "object"}, random.Random(1)) == {}


def test_seeds_give_different_arguments() -> None:
    drawn = {json.dumps(arguments_for(WEATHER, random.Random(s))) for s in range(20)}
    assert len(drawn) > 10
