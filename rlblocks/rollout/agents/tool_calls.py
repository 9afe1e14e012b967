"""Tool calls in the assistant's text: the Hermes/Qwen format and its parser (:func:`parse_tool_calls`).

Tool calls use the Hermes/Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the
assistant's text; results come back as ``tool`` role messages (the chat template decides how they render).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rlblocks._checks import check_str_pair
from rlblocks.errors import ArgumentError

__all__ = ["TOOL_CALL_TAGS", "ToolCall", "parse_tool_calls"]

TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")


@dataclass
class ToolCall:
    """One parsed call: ``name``, ``arguments`` (a dict), and ``raw`` (the text between the tags)."""

    name: str
    arguments: dict[str, Any]
    raw: str


def parse_tool_calls(text: str, *, tags: tuple[str, str] = TOOL_CALL_TAGS) -> tuple[list[ToolCall], list[str], str]:
    """Parse Hermes/Qwen tool calls ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` out of ``text``.

    ``arguments`` may also be a JSON string holding an object (OpenAI's wire form) or be called ``parameters``
    (Llama 3.1). Returns ``(calls, errors, content)``: the well-formed calls in order, one message per malformed
    block (invalid JSON, no name, arguments not an object, an opening tag never closed), and ``text`` with the
    well-formed blocks removed, stripped (malformed blocks stay in ``content``: nothing the model wrote is lost).
    """
    if not isinstance(text, str):
        raise ArgumentError(f"text: expected a str, got {type(text).__name__}")
    open_tag, close_tag = check_str_pair("tags", tags)
    calls: list[ToolCall] = []
    errors: list[str] = []
    pattern = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)
    kept: list[str] = []  # the text outside well-formed calls
    pos = 0
    for m in pattern.finditer(text):
        n_calls = len(calls)
        _parse_one(m.group(1).strip(), calls, errors)
        if len(calls) > n_calls:
            kept.append(text[pos:m.start()])
            pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept)
    rest = pattern.sub("", content)
    if open_tag in rest:  # an opening tag that was never closed (e.g. cut by the token budget)
        i = rest.rfind(open_tag)
        errors.append(f"unterminated tool call: {rest[i:i + 200]!r}")
    return calls, errors, content.strip()


def _parse_one(body: str, calls: list[ToolCall], errors: list[str]) -> None:
    """Parse one tool-call body into ``calls``, or describe why not into ``errors``."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        errors.append(f"could not parse the tool call as JSON ({e.msg} at character {e.pos}): {body[:200]!r}")
        return
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        errors.append(f"a tool call must be a JSON object with a string \"name\", got {body[:200]!r}")
        return
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            errors.append(f"tool {obj['name']!r}: arguments string is not JSON ({e.msg}): {args[:200]!r}")
            return
    if not isinstance(args, dict):
        errors.append(f"tool {obj['name']!r}: arguments must be a JSON object, got {type(args).__name__}")
        return
    calls.append(ToolCall(obj["name"], args, body))

