"""Token-in/token-out rendering: chat messages to token ids with per-token attribution.

Prompt tokens come from the tokenizer's chat template; sampled tokens are kept exactly as
sampled and never re-tokenized. A multi-turn prompt is the branch so far, plus the
unsampled end-of-turn scaffold after the sampled completion (ChatML's `\\n` after a sampled
`<|im_end|>`, or the whole footer when the sample was cut off), plus the tokens of the new
messages and the generation prompt. Those come from rendering the whole conversation and
checking that the rendering through the last assistant message is a token-exact prefix of
it. When it is not (the template rewrote history, e.g. dropped earlier `<think>` reasoning),
a new branch starts from the full rendering and only what is sampled after that is
`sampled` in it.

Attribution (per character of the rendered text, then per token by its first character):
  - a message's content is located exactly by rendering the conversation again with that
    content replaced by a sentinel: the two texts agree before and after it;
  - message k owns its turn: from just after the last end-of-turn token before its content
    (its header) to just after the first end-of-turn token after it, plus trailing
    whitespace (its footer); `is_content` marks the content, and for an assistant message
    everything up to its end-of-turn (tool calls included);
  - text owned by no message (a tools preamble, the generation prompt) gets -1.

Tool schemas are rendered by the template when it takes `tools`; a renderer made with
`describe_ignored_tools` (verifiers envs' turns) renders those a template ignores into the system
turn (`trace_rl.models.tool_schemas`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trace_rl.data.trace import Branch, Message
from trace_rl.models import tool_schemas
from trace_rl.models.runtime import Generation

SENTINELS = "\x00\x01\x02"
WHITESPACE = re.compile(r"\s*")


class RenderError(ValueError):
    """A conversation the renderer cannot turn into a prompt."""


def template_message(message: Message) -> dict[str, Any]:
    """A message as chat templates expect it (tool calls both flat and OpenAI-style under `function`)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "name": c.name, "arguments": c.arguments,
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    return out


def with_tool_names(messages: Sequence[Message]) -> list[Message]:
    """Tool messages without a `name` get the name of the assistant tool call their `tool_call_id` answers."""
    names: dict[str, str] = {}
    out = []
    for message in messages:
        for call in message.tool_calls or ():
            names[call.id] = call.name
        if message.role == "tool" and message.name is None and message.tool_call_id in names:
            message = message.model_copy(update={"name": names[message.tool_call_id]})
        out.append(message)
    return out


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class Rendered:
    """Token ids with attribution; `text` is what they decode to."""

    text: str
    token_ids: np.ndarray
    message_index: np.ndarray
    is_content: np.ndarray


class Renderer:
    """Renders messages with a tokenizer's chat template into attributed token ids."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None, end_of_turn: str | None = None,
                 *, describe_ignored_tools: bool = False):
        """`describe_ignored_tools`: when the template ignores `tools`, render them into the system turn
        (`tool_schemas.tools_block`); else they are left to the conversation's own text (trace-rl's envs
        describe their tools in their prompts)."""
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.end_of_turn = end_of_turn or tokenizer.eos_token
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        self.tools_in_system_turn = bool(self.tools) and describe_ignored_tools and not tool_schemas.probe(tokenizer)[0]

    def text(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        """The template's rendering; tools it ignores are in the system turn (`tool_schemas.tools_block`)."""
        chat = [template_message(m) for m in messages]
        if self.tools_in_system_turn:
            chat = tool_schemas.with_tools_in_system_turn(chat, self.tools)
        return self.tokenizer.apply_chat_template(
            chat, tools=None if self.tools_in_system_turn else self.tools,
            tokenize=False, add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of `text` and the character offset where each token starts."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        return ids, np.clip(offsets[:, 0], 0, max(len(text) - 1, 0))

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> Rendered:
        text = self.text(messages, add_generation_prompt=add_generation_prompt)
        ids, starts = self.encode(text)
        owner, content = self.attribute(text, messages, add_generation_prompt=add_generation_prompt)
        return Rendered(text, ids, owner[starts], content[starts])

    def extend(self, messages: Sequence[Message], covered: int, end_of_turn_sampled: bool) -> Rendered | None:
        """The tokens that follow a branch holding `messages[:covered]` (ending in a sampled assistant
        turn): unsampled footer + new messages + generation prompt. None if the template does not
        extend the earlier rendering token for token."""
        before = self.text(messages[:covered], add_generation_prompt=False)
        after = self.text(messages, add_generation_prompt=True)
        before_ids, _ = self.encode(before)
        after_ids, starts = self.encode(after)
        n = len(before_ids)
        if len(after_ids) < n or not np.array_equal(after_ids[:n], before_ids):
            return None
        ends = np.flatnonzero(before_ids == self.end_of_turn_id)
        if not ends.size:
            return None
        footer = before_ids[ends[-1] + 1 if end_of_turn_sampled else ends[-1]:]
        owner, content = self.attribute(after, messages, add_generation_prompt=True, first=covered, start=len(before))
        new_starts = starts[n:]
        return Rendered(
            text=self.tokenizer.decode(footer.tolist(), skip_special_tokens=False) + after[len(before):],
            token_ids=np.concatenate([footer, after_ids[n:]]),
            message_index=np.concatenate([np.full(len(footer), covered - 1, np.int32), owner[new_starts]]),
            is_content=np.concatenate([np.zeros(len(footer), bool), content[new_starts]]),
        )

    def attribute(
        self, text: str, messages: Sequence[Message], *, add_generation_prompt: bool, first: int = 0, start: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per character of `text` from `start` on: the owning message index (-1: none) and whether it is
        content. Only `messages[first:]` are attributed (the earlier ones end before `start`)."""
        points = _codepoints(text)
        owner = np.full(len(text), -1, np.int32)
        content = np.zeros(len(text), bool)
        spans = {k: self._content_span(points, messages, k, add_generation_prompt) for k in range(first, len(messages))}
        shown = [k for k, span in spans.items() if span is not None and span[0] >= start]
        turn_end = start
        for position, k in enumerate(shown):
            content_start, content_end = spans[k]
            if content_start < turn_end:
                continue
            next_start = spans[shown[position + 1]][0] if position + 1 < len(shown) else len(text)
            turn_start = self._after_end_of_turn(text, turn_end, content_start, last=True)
            end_of_turn = text.find(self.end_of_turn, content_end, next_start)
            turn_end = self._after_end_of_turn(text, content_end, next_start, last=False)
            owner[turn_start:turn_end] = k
            body_end = end_of_turn if messages[k].role == "assistant" and end_of_turn >= 0 else content_end
            content[content_start:body_end] = True
        return owner, content

    def _content_span(
        self, points: np.ndarray, messages: Sequence[Message], k: int, add_generation_prompt: bool
    ) -> tuple[int, int] | None:
        probe = list(messages)
        content = messages[k].content
        sentinel = next(c for c in SENTINELS if not (content.startswith(c) or content.endswith(c)))
        probe[k] = messages[k].model_copy(update={"content": sentinel})
        other = _codepoints(self.text(probe, add_generation_prompt=add_generation_prompt))
        if len(other) == len(points) and np.array_equal(other, points):
            return None  # the template does not show this message's content
        content_start = _common_prefix(points, other)
        from_back = _common_prefix(points[::-1], other[::-1])
        return content_start, max(content_start, len(points) - from_back)

    def _after_end_of_turn(self, text: str, lo: int, hi: int, *, last: bool) -> int:
        """Just past the first (or last) end-of-turn token in text[lo:hi] and its trailing whitespace; else lo."""
        found = text.rfind(self.end_of_turn, lo, hi) if last else text.find(self.end_of_turn, lo, hi)
        if found < 0:
            return lo
        return WHITESPACE.match(text, found + len(self.end_of_turn), hi).end()


Generate = Callable[[list[int], int], Awaitable[Generation]]


class Conversation:
    """One agent's side of a rollout: its messages and the token branches it saw and sampled.

    `generate(prompt_ids, turn)` samples one completion; `sample()` renders the prompt, calls it,
    appends the sampled tokens to the open branch and an assistant message to `messages`.
    """

    def __init__(self, renderer: Renderer, generate: Generate, *, temperature: float, messages: Sequence[Message] = ()):
        self.renderer = renderer
        self.temperature = float(temperature)
        self.messages: list[Message] = []
        self.turns = 0
        self.last_finish_reason: str | None = None
        self._generate = generate
        self._closed: list[Branch] = []
        self._open: list[dict[str, np.ndarray]] = []
        self._covered = 0
        self._end_of_turn_sampled = False
        self.add(*messages)

    def add(self, *messages: Message) -> None:
        self.messages = with_tool_names([*self.messages, *messages])

    @property
    def branches(self) -> list[Branch]:
        if not self._open:
            return list(self._closed)
        return [*self._closed, self._branch(len(self._closed), self._open)]

    def _prompt_ids(self) -> list[int]:
        """The next prompt: the open branch extended by the new messages, or a new branch."""
        if not self.messages or self.messages[-1].role == "assistant":
            raise RenderError("add a user or tool message before sampling (the last message is the assistant's)")
        rendered = None
        if self._open:
            rendered = self.renderer.extend(self.messages, self._covered, self._end_of_turn_sampled)
            if rendered is None:
                self._closed.append(self._branch(len(self._closed), self._open))
                self._open = []
        if rendered is None:
            rendered = self.renderer.render(self.messages, add_generation_prompt=True)
        n = len(rendered.token_ids)
        self._open.append({
            "token_ids": rendered.token_ids, "sampled": np.zeros(n, bool), "logprobs": np.zeros(n, np.float32),
            "message_index": rendered.message_index, "is_content": rendered.is_content,
        })
        return np.concatenate([chunk["token_ids"] for chunk in self._open]).tolist()

    async def sample(self) -> str:
        """Sample the assistant's next turn and return its text (without the end-of-turn token); the
        turn is recorded as an assistant message with that content (see `set_reply`)."""
        prompt = self._prompt_ids()
        generation = await self._generate(prompt, self.turns)
        self.turns += 1
        ids = np.asarray(generation.token_ids, dtype=np.int32)
        ended = bool(len(ids)) and int(ids[-1]) == self.renderer.end_of_turn_id
        text = self.renderer.tokenizer.decode(ids[: len(ids) - ended].tolist(), skip_special_tokens=False)
        is_content = np.ones(len(ids), bool)
        is_content[len(ids) - ended:] = False
        self._open.append({
            "token_ids": ids, "sampled": np.ones(len(ids), bool),
            "logprobs": np.asarray(generation.logprobs, dtype=np.float32),
            "message_index": np.full(len(ids), len(self.messages), np.int32), "is_content": is_content,
        })
        self.messages.append(Message(role="assistant", content=text))
        self._covered = len(self.messages)
        self._end_of_turn_sampled = ended
        self.last_finish_reason = generation.finish_reason
        return text

    def set_reply(self, message: Message) -> None:
        """Replace the last sampled turn's message by its parsed form (e.g. tool calls split off). Only
        later renderings see it; the branch keeps the sampled tokens."""
        if not self.messages or self.messages[-1].role != "assistant" or message.role != "assistant":
            raise RenderError("set_reply replaces the last sampled assistant message with another assistant message")
        self.messages[-1] = message

    def _branch(self, index: int, chunks: list[dict[str, np.ndarray]]) -> Branch:
        arrays = {name: np.concatenate([chunk[name] for chunk in chunks]) for name in chunks[0]}
        return Branch(index=index, temperature=self.temperature, **arrays)
