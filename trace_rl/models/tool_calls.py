"""Tool calls in a reply: `<tool_call>...</tool_call>` blocks in either of two formats.

- Hermes/Qwen (what Qwen2.5 and most open chat models emit):
  `<tool_call>\n{"name": "click_link", "arguments": {"page": 3}}\n</tool_call>`;
  `arguments` may also be a JSON string holding the object.
- the tiny model's compact form: `<tool_call>click_link {"page": 3}</tool_call>`.

A block whose text starts with `{` is read as Hermes, any other as the compact form. A
well-formed reply becomes an assistant message with the text before the first call as its
content and the calls as `tool_calls`. A reply with any malformed call (unclosed, no name,
arguments not a JSON object, text after the calls) runs none of its calls: it stays plain
content, so re-rendering reproduces it exactly, and each problem becomes an error for the
environment to answer with an observation instead of crashing the rollout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from trace_rl.data.trace import Message, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass
class ToolCallError:
    name: str | None  # the tool it tried to call, when that much is readable
    error: str


@dataclass
class ParsedReply:
    message: Message
    errors: list[ToolCallError] = field(default_factory=list)


def parse_call(body: str) -> ToolCall | ToolCallError:
    """One call's text as a ToolCall (its id filled in by the caller), or why it is malformed."""
    body = body.strip()
    if body.startswith("{"):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCallError(None, f"tool call is not valid JSON: {exc.msg} in {body[:80]!r}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not NAME.fullmatch(call["name"]):
            return ToolCallError(None, 'a tool call needs a "name" string: {"name": ..., "arguments": {...}}')
        name, arguments = call["name"], call.get("arguments", {})
    else:
        name, _, arguments = body.partition(" ")
        if not NAME.fullmatch(name):
            return ToolCallError(None, f"malformed tool call {body[:80]!r}: expected "
                                       '{"name": ..., "arguments": {...}} or \'name {json}\'')
    if isinstance(arguments, str):  # the compact form's text, or Hermes arguments given as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCallError(name, f"arguments of {name} are not valid JSON: {exc.msg}")
    if not isinstance(arguments, dict):
        return ToolCallError(name, f"arguments of {name} must be a JSON object")
    return ToolCall(id="", name=name, arguments=arguments)


def parse_tool_calls(text: str, call_prefix: str) -> ParsedReply:
    """The assistant message of `text`; calls get ids `<call_prefix>-<i>`."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    for i, match in enumerate(CALL.finditer(text)):
        parsed = parse_call(match.group(1))
        if isinstance(parsed, ToolCallError):
            errors.append(parsed)
        else:
            calls.append(parsed.model_copy(update={"id": f"{call_prefix}-{i}"}))
    if text.count(OPEN) > text.count(CLOSE):
        errors.append(ToolCallError(None, f"unclosed {OPEN}: close every call with {CLOSE}"))
    if calls and text.rsplit(CLOSE, 1)[-1].strip():
        errors.append(ToolCallError(None, f"text after the last {CLOSE}: end the reply with the tool calls"))
    if errors:
        return ParsedReply(Message(role="assistant", content=text), errors)
    content = text.split(OPEN, 1)[0]
    return ParsedReply(Message(role="assistant", content=content, tool_calls=calls or None), errors)
