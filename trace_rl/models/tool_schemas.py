"""How a chat template meets tools: whether it renders the tool schemas it is given, the system-turn block trace-rl
renders them in when it does not, and whether it writes tool calls in a format `trace_rl.models.tool_calls` reads.

Templates that take `tools` (Qwen2.5, Qwen3, Hermes 2/3, Llama 3.1+, Mistral, ...) render them as their model was
trained to see them. Templates that ignore them (SmolLM2's, the tiny model's) would leave the model unaware of the
tools, so the schemas go into the system turn (a system message first, the existing system text before them) as
`DEFAULT_TOOLS_BLOCK`: one JSON schema a line between `<tools>` tags, and how to call one in the Hermes format.
Each template is probed once per process (two renderings of a probe conversation) and what it lacks is logged once.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from trace_rl.models.tool_calls import parse_tool_calls

logger = logging.getLogger(__name__)

DEFAULT_TOOLS_BLOCK = (
    "# Tools\n\nYou may call the tools below. Their JSON schemas, one a line:\n<tools>\n{schemas}\n</tools>\n\n"
    'To call a tool, end your reply with one block per call:\n<tool_call>{{"name": "<tool name>", "arguments": '
    "{{<its arguments as a JSON object>}}}}</tool_call>"
)
PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}
PROBE_CALL = {"id": "probe", "type": "function", "name": "probe_tool", "arguments": {"probe_key": "probe_value"},
              "function": {"name": "probe_tool", "arguments": {"probe_key": "probe_value"}}}

_probed: dict[str, tuple[bool, bool]] = {}  # chat template -> (renders tools, writes calls trace-rl parses)


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The default rendering of tool schemas (`DEFAULT_TOOLS_BLOCK`)."""
    return DEFAULT_TOOLS_BLOCK.format(schemas="\n".join(json.dumps(tool) for tool in tools))


def with_tools_in_system_turn(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Template messages with `tools_block` appended to the system message (one is added first if there is none)."""
    if messages and messages[0]["role"] == "system":
        system = {**messages[0], "content": f"{messages[0]['content']}\n\n{tools_block(tools)}"}
        return [system, *messages[1:]]
    return [{"role": "system", "content": tools_block(tools)}, *messages]


def probe(tokenizer: Any) -> tuple[bool, bool]:
    """(whether the tokenizer's chat template renders `tools`, whether it writes an assistant's tool calls in a
    format `parse_tool_calls` reads back); logged once per template when either is false."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else repr(tokenizer.chat_template)
    if template in _probed:
        return _probed[template]
    user = [{"role": "user", "content": "probe"}]
    render = tokenizer.apply_chat_template
    try:
        takes_tools = render(user, tools=[PROBE_TOOL], tokenize=False) != render(user, tools=None, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses tools (raise_exception) shows none
        takes_tools = False
    conversation = [*user, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}]
    try:
        text = render(conversation, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses tool calls (raise_exception) writes none we read
        text = ""
    calls = parse_tool_calls(text[text.find("<tool_call>"):text.rfind("</tool_call>") + len("</tool_call>")],
                             "probe").message.tool_calls or []
    parses_calls = [(c.name, c.arguments) for c in calls] == [("probe_tool", {"probe_key": "probe_value"})]
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    if not takes_tools:
        logger.warning("the chat template of %s ignores `tools`: trace-rl renders the tool schemas into the system "
                       "turn in its default format (docs/envs.md#tools)", name)
    if not parses_calls:
        logger.warning("the chat template of %s does not write tool calls as <tool_call> blocks: sampled calls are "
                       "read as <tool_call> blocks (Hermes or compact) only (docs/envs.md#tools)", name)
    _probed[template] = (takes_tools, parses_calls)
    return _probed[template]
