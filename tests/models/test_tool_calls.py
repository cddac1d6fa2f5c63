"""Tool calls in sampled text (`trace_rl.models.tool_calls`) and how a chat template meets tools
(`trace_rl.models.tool_schemas`): the Hermes/Qwen and compact formats, well-formed, malformed, several calls, text
before calls; which templates render tools and write calls trace-rl reads; the default system-turn tools block."""

from __future__ import annotations

import json

import pytest

from trace_rl.data.trace import Message
from trace_rl.models import tool_schemas
from trace_rl.models.realistic import chat_template
from trace_rl.models.render import Renderer
from trace_rl.models.tiny import build_tokenizer
from trace_rl.models.tool_calls import parse_tool_calls

KEY = {"type": "object", "properties": {"key": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": KEY}}]
# a Llama-3.1-style template: calls as bare JSON with "parameters", no <tool_call> tags
BARE_JSON_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- if message.get('tool_calls') %}{%- for call in message['tool_calls'] %}"
    "{{ {'name': call['function']['name'], 'parameters': call['function']['arguments']} | tojson }}"
    "{%- endfor %}{%- else %}{{ message['content'] }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def tokenizer_with(template: str | None):
    tokenizer = build_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def test_parse_tool_calls():
    parsed = parse_tool_calls('ok <tool_call>click_link {"page": "oak"}</tool_call><tool_call>go_back</tool_call>', "c")
    assert parsed.errors == [] and parsed.message.content == "ok "
    assert [(c.id, c.name, c.arguments) for c in parsed.message.tool_calls] == [
        ("c-0", "click_link", {"page": "oak"}), ("c-1", "go_back", {})]
    for text, error in [
        ("<tool_call>click_link [1]</tool_call>", "must be a JSON object"),
        ("<tool_call>{}</tool_call>", 'needs a "name" string'),
        ("<tool_call>1 {}</tool_call>", "expected {\"name\": ..., \"arguments\": {...}} or 'name {json}'"),
        ("<tool_call>go_back {}", "unclosed"),
        ("<tool_call>go_back {}</tool_call> and more", "text after the last"),
    ]:
        parsed = parse_tool_calls(text, "c")
        assert error in parsed.errors[0].error and parsed.message.content == text and not parsed.message.tool_calls


def test_parse_hermes_tool_calls_as_qwen_emits_them():
    text = ('Let me look.\n<tool_call>\n{"name": "click_link", "arguments": {"page": "oak"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "go_back", "arguments": "{}"}\n</tool_call>')
    parsed = parse_tool_calls(text, "c")
    assert parsed.errors == [] and parsed.message.content == "Let me look.\n"
    assert [(c.id, c.name, c.arguments) for c in parsed.message.tool_calls] == [
        ("c-0", "click_link", {"page": "oak"}), ("c-1", "go_back", {})]
    for text, error in [
        ('<tool_call>\n{"name": "click_link", "arguments": {"page": }\n</tool_call>', "not valid JSON"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'needs a "name" string'),
        ('<tool_call>\n{"name": "go_back", "arguments": [1]}\n</tool_call>', "must be a JSON object"),
        ('<tool_call>\n{"name": "go_back", "arguments": "{oops"}\n</tool_call>', "arguments of go_back are not"),
        ('<tool_call>\n{"name": "go_back"}\n</tool_call><tool_call>\n{"name": ', "unclosed"),
    ]:
        parsed = parse_tool_calls(text, "c")
        assert error in parsed.errors[0].error and parsed.message.content == text and not parsed.message.tool_calls


@pytest.mark.parametrize("template, takes_tools, parses_calls", [
    (None, False, True),  # the tiny model's ChatML: ignores tools, writes compact <tool_call> blocks
    (chat_template(), True, True),  # Qwen-style: renders tools, writes Hermes blocks
    (BARE_JSON_TEMPLATE, True, False),
])
def test_probe_tells_what_a_template_does_with_tools(template, takes_tools, parses_calls):
    assert tool_schemas.probe(tokenizer_with(template)) == (takes_tools, parses_calls)


def test_tools_a_template_ignores_go_into_the_system_turn_and_attribution_holds():
    tokenizer = tokenizer_with(None)
    block = tool_schemas.tools_block(TOOLS)
    assert json.loads(block.split("<tools>\n")[1].split("\n</tools>")[0]) == TOOLS[0]
    messages = [Message(role="system", content="Be brief."), Message(role="user", content="What is oak?")]
    rendered = Renderer(tokenizer, TOOLS, describe_ignored_tools=True).render(messages)
    assert rendered.text.startswith(f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n<|im_start|>user\n")
    system = tokenizer.decode(rendered.token_ids[(rendered.message_index == 0) & rendered.is_content])
    assert system == "Be brief."  # the block is scaffold, the system text stays the message's content
    bare = Renderer(tokenizer, TOOLS, describe_ignored_tools=True).render(messages[1:])
    assert bare.text.startswith(f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\nWhat is oak?")
    assert (bare.message_index[:len(tokenizer.encode(f"<|im_start|>system\n{block}<|im_end|>\n"))] == -1).all()
    plain = "<|im_start|>user\nWhat is oak?<|im_end|>\n<|im_start|>assistant\n"
    assert Renderer(tokenizer, None, describe_ignored_tools=True).render(messages[1:]).text == plain
    assert Renderer(tokenizer, TOOLS).render(messages[1:]).text == plain  # trace-rl's envs describe their own
    qwen_renderer = Renderer(tokenizer_with(chat_template()), TOOLS, describe_ignored_tools=True)
    qwen = qwen_renderer.render(messages[1:]).text  # the template's own rendering
    assert qwen.count('"name": "lookup"') == 1 and "You may call the tools below" not in qwen
