"""`link-nav`: a tool environment. Navigate a small generated link graph from a start page to a target.

Tools: `click_link {"page": NAME}` follows a link of the current page, `go_back {}` returns to the
previous page. The episode opens with a scripted `click_link` to the start page, so the page and
its links always arrive as a tool message. Every tool result is a `tool` message carrying the tool
name; malformed or failing calls get an error observation. The episode ends when the model answers
without a tool call, reaches the target, or runs out of turns.

Reward: progress toward the target in shortest-path distance, (d_start - d_end) / d_start, clipped
to [0, 1] (1 exactly when the target is reached).
"""

from __future__ import annotations

import random
from collections import deque

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trace_rl.data.trace import Message, ToolCall, Trace
from trace_rl.envs.base import Environment, Example, Sampler
from trace_rl.envs.registry import register_env
from trace_rl.models.tool_calls import parse_tool_calls

WORDS = (
    "oak", "elm", "fig", "ash", "bay", "ivy", "yew", "rye", "kelp", "moss", "fern", "sage", "reed", "lime", "pine",
    "rose", "mint", "palm", "teak", "vine", "corn", "bean", "pea", "nut",
)
TOOLS = [
    {"type": "function", "function": {
        "name": "click_link", "description": "Follow a link on the current page.",
        "parameters": {"type": "object", "properties": {"page": {"type": "string"}}, "required": ["page"]}}},
    {"type": "function", "function": {
        "name": "go_back", "description": "Return to the previous page.",
        "parameters": {"type": "object", "properties": {}}}},
]
SYSTEM = (
    "Reach the target page. Tools: click_link {\"page\": NAME} and go_back {}. "
    "Call one as <tool_call>click_link {\"page\": \"oak\"}</tool_call>."
)


class LinkNavOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pages: int = Field(6, ge=3, le=len(WORDS))
    links_per_page: int = Field(2, ge=1)
    max_turns: int = Field(4, ge=1, description="model turns before the episode stops")
    system_prompt: str = SYSTEM

    @model_validator(mode="after")
    def _links(self) -> LinkNavOptions:
        if self.links_per_page >= self.pages:
            raise ValueError(f"links_per_page {self.links_per_page} must be below pages {self.pages}")
        return self


def distances(links: dict[str, list[str]], target: str) -> dict[str, int]:
    """Shortest number of clicks from every page to `target` (pages that cannot reach it are absent)."""
    incoming: dict[str, list[str]] = {page: [] for page in links}
    for page, outs in links.items():
        for out in outs:
            incoming[out].append(page)
    found = {target: 0}
    queue = deque([target])
    while queue:
        page = queue.popleft()
        for source in incoming[page]:
            if source not in found:
                found[source] = found[page] + 1
                queue.append(source)
    return found


def describe(page: str, links: dict[str, list[str]]) -> str:
    return f"Page: {page}. Links: {', '.join(links[page])}."


@register_env("link-nav")
class LinkNav(Environment):
    Options = LinkNavOptions

    def make_example(self, rng: random.Random) -> dict:
        pages = rng.sample(WORDS, self.args.pages)
        # a random cycle keeps every page reachable; the other links are random
        links = {page: [pages[(i + 1) % len(pages)]] for i, page in enumerate(pages)}
        for page in pages:
            others = [p for p in pages if p != page and p not in links[page]]
            links[page] += rng.sample(others, self.args.links_per_page - 1)
            rng.shuffle(links[page])
        start = pages[0]
        target = rng.choice(pages[1:])
        return {"links": links, "start": start, "target": target}

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        links, start, target = example.data["links"], example.data["start"], example.data["target"]
        to_target = distances(links, target)
        opening = ToolCall(id="call-0-0", name="click_link", arguments={"page": start})
        conversation = sampler.conversation(
            [
                Message(role="system", content=self.args.system_prompt),
                Message(role="user", content=f"Go from {start} to {target}."),
                Message(role="assistant", content="", tool_calls=[opening]),
                Message(role="tool", tool_call_id=opening.id, content=describe(start, links)),
            ],
            tools=TOOLS,
        )
        path, history = [start], []
        tool_calls = invalid_calls = 0
        for turn in range(1, self.args.max_turns + 1):
            reply = parse_tool_calls(await conversation.sample(), call_prefix=f"call-{turn}")
            conversation.set_reply(reply.message)
            if not reply.message.tool_calls and not reply.errors:
                break
            observations = []
            for call in reply.message.tool_calls or ():
                tool_calls += 1
                result, ok = self._run(call, links, path, history)
                invalid_calls += not ok
                observations.append(Message(role="tool", name=call.name, tool_call_id=call.id, content=result))
            for error in reply.errors:
                invalid_calls += 1
                observations.append(Message(role="tool", name=error.name or "invalid", content=f"error: {error.error}"))
            conversation.add(*observations)
            if path[-1] == target:
                break
        reached = path[-1] == target
        progress = max(0.0, (to_target[start] - to_target.get(path[-1], to_target[start])) / to_target[start])
        return [self.trace(
            example, conversation, reward=progress, rewards={"reached": float(reached), "progress": progress},
            metrics={"tool_calls": tool_calls, "invalid_calls": invalid_calls, "moves": len(path) - 1},
            info={"answer": target, "path": path},
        )]

    @staticmethod
    def _run(call: ToolCall, links: dict[str, list[str]], path: list[str], history: list[str]) -> tuple[str, bool]:
        """Apply one tool call to the position (`path[-1]`); the observation text and whether it worked."""
        here = path[-1]
        if call.name == "click_link":
            page = call.arguments.get("page")
            if page not in links[here]:
                return f"error: no link to {page!r} on {here}. {describe(here, links)}", False
            history.append(here)
            path.append(page)
            return describe(page, links), True
        if call.name == "go_back":
            if not history:
                return f"error: no previous page. {describe(here, links)}", False
            path.append(history.pop())
            return describe(path[-1], links), True
        return f"error: unknown tool {call.name!r}; use click_link or go_back", False
