"""`secret-lookup`: a one-tool environment. The model is asked for the secret number of a word, which it can only
learn by calling `lookup {"word": WORD}`; the tool answers with the number, then the model answers the user. The
conversation opens with one scripted exchange about another word (the call, its result, the answer), so the model
sees a call made before it has to make its own.

Each example draws a word and a three-digit secret number per word, so guessing is right about once in 900. Calls
use the compact form `<tool_call>lookup {"word": "oak"}</tool_call>` or the Hermes form (trace_rl/models/tool_calls).
A malformed call, an unknown tool or a word without a number gets an error observation. The episode ends when the
model answers without a tool call or runs out of turns.

Reward: 1 when the final reply contains the asked word's secret number, else 0. Metrics: `tool_calls`,
`invalid_calls`, and `lookup_success` (1 when a `lookup` of the asked word returned its number), whose step mean is
the fraction of episodes with a successful tool call.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from trace_rl.data.trace import Message, ToolCall, Trace
from trace_rl.envs.base import Environment, Example, Sampler
from trace_rl.envs.link_nav import WORDS
from trace_rl.envs.registry import register_env
from trace_rl.models.tool_calls import parse_tool_calls

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "The secret number of a word.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}},
]
SYSTEM = (
    "You cannot know secret numbers. To look one up, reply with only a tool call, "
    "<tool_call>lookup {\"word\": \"oak\"}</tool_call> for oak. Then answer with the number."
)


class SecretLookupOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_turns: int = Field(2, ge=1, description="model turns before the episode stops")
    system_prompt: str = SYSTEM


@register_env("secret-lookup")
class SecretLookup(Environment):
    Options = SecretLookupOptions

    def make_example(self, rng: random.Random) -> dict:
        word = rng.choice(WORDS)
        return {"word": word, "secrets": {w: rng.randrange(100, 1000) for w in WORDS}}

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        word, secrets = example.data["word"], example.data["secrets"]
        answer = str(secrets[word])
        shown = next(w for w in WORDS if w != word)
        # the call as text: a chat template that writes no tool calls (SmolLM2's) would drop a `tool_calls` call
        demonstration = f'<tool_call>lookup {{"word": "{shown}"}}</tool_call>'
        conversation = sampler.conversation(
            [Message(role="system", content=self.args.system_prompt),
             Message(role="user", content=f"What is the secret number of {shown}?"),
             Message(role="assistant", content=demonstration),
             Message(role="tool", name="lookup", content=f"The secret number of {shown} is {secrets[shown]}."),
             Message(role="assistant", content=f"The secret number of {shown} is {secrets[shown]}."),
             Message(role="user", content=f"What is the secret number of {word}?")],
            tools=TOOLS,
        )
        tool_calls = invalid_calls = 0
        looked_up = False
        reply_text = ""
        for turn in range(1, self.args.max_turns + 1):
            reply = parse_tool_calls(await conversation.sample(), call_prefix=f"call-{turn}")
            conversation.set_reply(reply.message)
            reply_text = reply.message.content or ""
            if not reply.message.tool_calls and not reply.errors:
                break
            observations = []
            for call in reply.message.tool_calls or ():
                tool_calls += 1
                result, ok = self._run(call, secrets)
                invalid_calls += not ok
                looked_up |= ok and call.arguments.get("word") == word
                observations.append(Message(role="tool", name=call.name, tool_call_id=call.id, content=result))
            for error in reply.errors:
                invalid_calls += 1
                observations.append(Message(role="tool", name=error.name or "invalid", content=f"error: {error.error}"))
            conversation.add(*observations)
        correct = float(answer in reply_text)
        return [self.trace(
            example, conversation, reward=correct, rewards={"correct": correct},
            metrics={"tool_calls": tool_calls, "invalid_calls": invalid_calls, "lookup_success": float(looked_up)},
            info={"answer": answer},
        )]

    @staticmethod
    def _run(call: ToolCall, secrets: dict[str, int]) -> tuple[str, bool]:
        """One tool call's observation text and whether it worked."""
        if call.name != "lookup":
            return f"error: unknown tool {call.name!r}; use lookup", False
        word = call.arguments.get("word")
        if word not in secrets:
            return f"error: no secret number for {word!r}", False
        return f"The secret number of {word} is {secrets[word]}.", True
