"""Token-in/token-out rendering on the tiny model's ChatML template and a Qwen-style template with tools
and <think> reasoning, driven by scripted completions so every expected token is known."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from trace_rl.models.realistic import chat_template
from trace_rl.data.trace import Message, ToolCall, Trace
from trace_rl.models.render import Conversation, Renderer, RenderError
from trace_rl.models.runtime import Generation
from trace_rl.models.tiny import build_tokenizer

QWEN_STYLE = chat_template()  # trace_rl/models/qwen_style.jinja, the realistic fixture's template
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def qwen_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN_STYLE
    return tokenizer


def scripted(tokenizer, completions: list[tuple[str, bool]], prompts: list[list[int]]):
    """A generate function returning `completions` in order (text, ended with end-of-turn), logprob -0.25
    per token; it records each prompt it was given."""

    async def generate(prompt_ids: list[int], turn: int) -> Generation:
        prompts.append(list(prompt_ids))
        text, ended = completions[turn]
        ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if ended else [])
        return Generation(token_ids=ids, logprobs=[-0.25] * len(ids), finish_reason="stop" if ended else "length")

    return generate


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def content_of(tokenizer, branch, k: int) -> str:
    keep = (branch.message_index == k) & branch.is_content
    return decode(tokenizer, branch.token_ids[keep])


def test_single_render_attributes_every_message(tiny_tokenizer):
    renderer = Renderer(tiny_tokenizer)
    messages = [Message(role="system", content="be brief"), Message(role="user", content="héllo\nworld")]
    rendered = renderer.render(messages)
    assert decode(tiny_tokenizer, rendered.token_ids) == rendered.text
    assert rendered.text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo\nworld<|im_end|>\n<|im_start|>assistant\n"
    )
    by_message = {k: decode(tiny_tokenizer, rendered.token_ids[rendered.message_index == k]) for k in (-1, 0, 1)}
    assert by_message == {
        0: "<|im_start|>system\nbe brief<|im_end|>\n",
        1: "<|im_start|>user\nhéllo\nworld<|im_end|>\n",
        -1: "<|im_start|>assistant\n",
    }
    # 'é' is two byte tokens, both attributed to the content
    user_content = rendered.is_content & (rendered.message_index == 1)
    assert decode(tiny_tokenizer, rendered.token_ids[user_content]) == "héllo\nworld"
    assert not rendered.is_content[rendered.message_index == -1].any()


def test_tiny_multi_turn_extends_one_branch_token_exactly(tiny_tokenizer):
    prompts: list[list[int]] = []
    completions = [('<tool_call>lookup {"key": "a"}</tool_call>', True), ("don", False), ("done", True)]
    conversation = Conversation(
        Renderer(tiny_tokenizer), scripted(tiny_tokenizer, completions, prompts), temperature=0.7,
        messages=[Message(role="user", content="find a")],
    )

    async def run():
        await conversation.sample()
        call = ToolCall(id="c1", name="lookup", arguments={"key": "a"})
        conversation.set_reply(Message(role="assistant", content="", tool_calls=[call]))
        conversation.add(Message(role="tool", tool_call_id="c1", content="a=1"))
        assert await conversation.sample() == "don"  # cut off: no end-of-turn token was sampled
        conversation.add(Message(role="user", content="finish"))
        return await conversation.sample()

    assert asyncio.run(run()) == "done"
    [branch] = conversation.branches
    assert branch.temperature == 0.7
    messages = conversation.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert messages[2].name == "lookup"  # joined through tool_call_id
    # token-exact: the branch decodes to the rendered conversation (less the unsampled "\n" after the last eos)
    full = Renderer(tiny_tokenizer).text(messages, add_generation_prompt=False)
    assert decode(tiny_tokenizer, branch.token_ids) + "\n" == full
    # each prompt is the previous branch prefix: nothing sampled was re-tokenized
    for earlier, later in zip(prompts, prompts[1:]):
        assert later[: len(earlier)] == earlier
    assert np.array_equal(branch.token_ids[: len(prompts[-1])], prompts[-1])
    # sampled tokens: exactly the three completions; the eos after 'don' was never sampled
    sampled = decode(tiny_tokenizer, branch.token_ids[branch.sampled])
    assert sampled == '<tool_call>lookup {"key": "a"}</tool_call><|im_end|>' + "don" + "done<|im_end|>"
    assert np.all(branch.logprobs[branch.sampled] == np.float32(-0.25))
    assert np.all(branch.logprobs[~branch.sampled] == 0)
    # the scaffold after a sampled turn belongs to that assistant message and is not sampled
    after_don = decode(tiny_tokenizer, branch.token_ids[(branch.message_index == 3) & ~branch.sampled])
    assert after_don == "<|im_end|>\n"
    after_call = decode(tiny_tokenizer, branch.token_ids[(branch.message_index == 1) & ~branch.sampled])
    assert after_call == "\n"
    assert content_of(tiny_tokenizer, branch, 2) == "a=1"
    assert content_of(tiny_tokenizer, branch, 4) == "finish"
    assert content_of(tiny_tokenizer, branch, 5) == "done"
    # generation prompts are scaffold owned by no message
    assert decode(tiny_tokenizer, branch.token_ids[branch.message_index == -1]) == "<|im_start|>assistant\n" * 3
    trace = Trace(id="t", env="e", example_id="x", group_id="g", branches=conversation.branches, messages=messages)
    assert Trace.from_json(trace.to_json()).equals(trace)


def test_qwen_style_tool_turns_extend_and_user_turn_after_reasoning_starts_new_branch(qwen_tokenizer):
    prompts: list[list[int]] = []
    first = '<think>\nneed data\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>'
    completions = [
        (first, True), ("<think>\nhave it\n</think>\n\na is 1", True), ("<think>\nok\n</think>\n\nbye", True),
    ]
    renderer = Renderer(qwen_tokenizer, TOOLS)
    conversation = Conversation(
        renderer, scripted(qwen_tokenizer, completions, prompts), temperature=1.0,
        messages=[Message(role="system", content="be exact"), Message(role="user", content="what is a?")],
    )

    async def run():
        await conversation.sample()
        conversation.set_reply(Message(
            role="assistant", content="<think>\nneed data\n</think>\n\n",
            tool_calls=[ToolCall(id="c1", name="lookup", arguments={"key": "a"})],
        ))
        conversation.add(Message(role="tool", tool_call_id="c1", content="a=1"))
        await conversation.sample()  # the tool result keeps the reasoning: same branch
        conversation.add(Message(role="user", content="thanks"))
        await conversation.sample()  # a new user turn drops earlier reasoning: new branch

    asyncio.run(run())
    first_branch, second_branch = conversation.branches
    messages = conversation.messages
    assert [b.index for b in conversation.branches] == [0, 1]
    assert messages[3].name == "lookup"
    # each branch decodes to the conversation as the template rendered it when that branch was sampled
    first_text, second_text = (decode(qwen_tokenizer, b.token_ids) for b in (first_branch, second_branch))
    assert first_text + "\n" == renderer.text(messages[:5], add_generation_prompt=False)
    assert second_text + "\n" == renderer.text(messages, add_generation_prompt=False)
    assert "need data" in decode(qwen_tokenizer, first_branch.token_ids)
    assert "need data" not in decode(qwen_tokenizer, second_branch.token_ids)
    # the first branch holds both sampled turns; the new branch only the last one
    both_turns = first + "<|im_end|>" + completions[1][0] + "<|im_end|>"
    assert decode(qwen_tokenizer, first_branch.token_ids[first_branch.sampled]) == both_turns
    assert decode(qwen_tokenizer, second_branch.token_ids[second_branch.sampled]) == completions[2][0] + "<|im_end|>"
    assert set(second_branch.message_index[second_branch.sampled]) == {6}
    # attribution: the tool result sits inside <tool_response> of a user turn and is the tool message's content
    for branch in (first_branch, second_branch):
        assert content_of(qwen_tokenizer, branch, 3) == "a=1"
        assert content_of(qwen_tokenizer, branch, 1) == "what is a?"
        tool_turn = decode(qwen_tokenizer, branch.token_ids[branch.message_index == 3])
        assert tool_turn == "<|im_start|>user\n<tool_response>\na=1\n</tool_response><|im_end|>\n"
        tools_block = decode(qwen_tokenizer, branch.token_ids[(branch.message_index == 0) & ~branch.is_content])
        assert '"name": "lookup"' in tools_block
    # in the new branch the earlier assistant turns are re-rendered prompt tokens, reasoning dropped
    assert content_of(qwen_tokenizer, second_branch, 4) == "a is 1"
    assert content_of(qwen_tokenizer, second_branch, 5) == "thanks"
    assert not second_branch.sampled[second_branch.message_index == 4].any()


def test_sampling_needs_a_new_message(tiny_tokenizer):
    generate = scripted(tiny_tokenizer, [("x", True)] * 2, [])
    conversation = Conversation(
        Renderer(tiny_tokenizer), generate, temperature=1.0, messages=[Message(role="user", content="hi")]
    )
    asyncio.run(conversation.sample())
    with pytest.raises(RenderError, match="add a user or tool message"):
        asyncio.run(conversation.sample())
