"""Tool calls in the tiny model's text format: `<tool_call>name {json arguments}</tool_call>`.

A well-formed reply becomes an assistant message with the text before the first call as its
content and the calls as `tool_calls`. A reply with any malformed call (unclosed, no name,
arguments not a JSON object, text after the calls) runs none of its calls: it stays plain
content, so re-rendering reproduces it exactly, and each problem becomes an error for the
environment to answer with an observation instead of crashing the rollout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from trace_rl.trace import Message, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class ToolCallError:
    name: str | None  # the tool it tried to call, when that much is readable
    error: str


@dataclass
class ParsedReply:
    message: Message
    errors: list[ToolCallError] = field(default_factory=list)


def parse_tool_calls(text: str, call_prefix: str) -> ParsedReply:
    """The assistant message of `text`; calls get ids `<call_prefix>-<i>`."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    for i, match in enumerate(CALL.finditer(text)):
        name, _, raw = match.group(1).strip().partition(" ")
        if not NAME.fullmatch(name):
            errors.append(ToolCallError(None, f"malformed tool call {match.group(0)[:80]!r}: expected 'name {{json}}'"))
            continue
        try:
            arguments = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            errors.append(ToolCallError(name, f"arguments of {name} are not valid JSON: {exc.msg}"))
            continue
        if not isinstance(arguments, dict):
            errors.append(ToolCallError(name, f"arguments of {name} must be a JSON object"))
            continue
        calls.append(ToolCall(id=f"{call_prefix}-{i}", name=name, arguments=arguments))
    if text.count(OPEN) > text.count(CLOSE):
        errors.append(ToolCallError(None, f"unclosed {OPEN}: close every call with {CLOSE}"))
    if calls and text.rsplit(CLOSE, 1)[-1].strip():
        errors.append(ToolCallError(None, f"text after the last {CLOSE}: end the reply with the tool calls"))
    if errors:
        return ParsedReply(Message(role="assistant", content=text), errors)
    content = text.split(OPEN, 1)[0]
    return ParsedReply(Message(role="assistant", content=content, tool_calls=calls or None), errors)
