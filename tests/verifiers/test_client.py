"""trace-rl's verifiers client answers a sampled turn with verifiers' assistant message: its tool calls as
`tool_calls`, the text before them as content; a malformed call stays text and verifiers sees no call."""

from __future__ import annotations

import json

from trace_rl.verifiers.client import assistant_message


def test_sampled_calls_become_verifiers_tool_calls():
    text = ('Checking both.\n<tool_call>\n{"name": "facts_lookup", "arguments": {"key": "oak"}}\n</tool_call>\n'
            '<tool_call>facts_lookup {"key": "tin"}</tool_call>')
    message = assistant_message(text, "call-0-2")
    assert message.content == "Checking both.\n"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("call-0-2-0", "facts_lookup", {"key": "oak"}), ("call-0-2-1", "facts_lookup", {"key": "tin"})]
    plain = assistant_message("no call here", "c")
    assert plain.content == "no call here" and not plain.tool_calls
    for malformed in ('<tool_call>{"name": "facts_lookup", "arguments": {oops}}</tool_call>',
                      '<tool_call>{"name": "facts_lookup", "arguments": {}}',
                      '<tool_call>{"name": "facts_lookup", "arguments": {}}</tool_call> then more'):
        message = assistant_message(malformed, "c")
        assert message.content == malformed and not message.tool_calls
