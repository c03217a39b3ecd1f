"""Tool calls in the "hermes" format: what a Hermes/Qwen-style ChatML model writes to call a
function, and how vLLM (`--enable-auto-tool-choice --tool-call-parser hermes`) reads it back.

A call is a JSON object between tags, one call per block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "paris"}}
    </tool_call>

`parse_tool_calls` keeps the rules of vLLM's Hermes2ProToolParser.extract_tool_calls: every
`<tool_call>…</tool_call>` block, plus a final `<tool_call>` left unterminated, is one call; if
any of them is not a JSON object with a string "name" and an "arguments" field, nothing is a
call and the whole text is the reply's content. Pure functions, no I/O: the simulated engine
renders and emits calls with them, the gateway parses replies with them.
"""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from dataclasses import dataclass
from string import ascii_lowercase
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# A closed block, or an unterminated one running to the end of the text (a reply cut short).
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCallParsed:
    """One call found in a reply; `arguments` is a JSON string, as OpenAI's API carries it."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A model's reply split into text and calls. With calls, `content` is the text before the
    first `<tool_call>`, as it is (None if empty); without (no tag, or a call that
    does not parse), `content` is the whole text unchanged and `calls` is empty."""

    content: str | None
    calls: list[ToolCallParsed]


def render_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text a Hermes/Qwen model emits for one call (the chat template renders an
    assistant's earlier calls the same way, with `tojson`'s separators)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def parse_tool_calls(text: str) -> ParsedReply:
    """The calls in a model's reply, by vLLM's hermes rules (module docstring)."""
    start = text.find(TOOL_CALL_OPEN)
    if start == -1:
        return ParsedReply(content=text, calls=[])
    calls = []
    for match in _TOOL_CALL_RE.finditer(text):
        call = _parse_call(match.group(1) or match.group(2) or "")
        if call is None:
            return ParsedReply(content=text, calls=[])  # vLLM's fallback: all of it is text
        calls.append(call)
    return ParsedReply(content=text[:start] or None, calls=calls)  # as vLLM: not stripped


def _parse_call(body: str) -> ToolCallParsed | None:
    """One block's JSON as a call, or None where vLLM's parser would fail on it."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    return ToolCallParsed(name=obj["name"],
                          arguments=json.dumps(obj["arguments"], ensure_ascii=False))


def tool_call_id() -> str:
    """A fresh call id in vLLM's form: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def arguments_for(schema: dict[str, Any] | None, rng: random.Random) -> dict[str, Any]:
    """Arguments valid for a function's JSON-schema `parameters`: its required properties (all
    of them when none is required), each given a plain value of its type. The same `rng` state
    gives the same arguments."""
    properties = (schema or {}).get("properties") or {}
    names = (schema or {}).get("required") or list(properties)
    return {name: _value_for(properties.get(name) or {}, rng) for name in names}


def _value_for(prop: dict[str, Any], rng: random.Random) -> Any:
    """A value of one property's schema: an enum member, a constant, the first branch of an
    anyOf/oneOf, or by type — short lowercase words, a small integer within any bounds given, a
    boolean, null, an empty array or object. An untyped property gets words (any value fits)."""
    if "enum" in prop and prop["enum"]:
        return rng.choice(prop["enum"])
    if "const" in prop:
        return prop["const"]
    for key in ("anyOf", "oneOf"):
        if prop.get(key):
            return _value_for(prop[key][0], rng)
    kind = prop.get("type", "string")
    if isinstance(kind, list):  # e.g. ["string", "null"]: the first concrete type
        kind = next((k for k in kind if k != "null"), "null")
    if kind in ("integer", "number"):
        low = math.ceil(prop.get("minimum", 0))
        return rng.randint(low, max(low, math.floor(prop.get("maximum", low + 100))))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        return []
    if kind == "object":
        return {}
    return " ".join(_word(rng) for _ in range(rng.randint(1, 3)))


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(ascii_lowercase) for _ in range(rng.randint(3, 7)))
