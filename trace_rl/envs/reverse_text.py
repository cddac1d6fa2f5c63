"""`reverse-text`: reverse a short string; dense reward by character-level similarity.

The demo environment: strings are short (3-6 lowercase letters by default) and the reward is
difflib's similarity ratio of the completion (up to the end-of-turn token, stripped) to the
reversed string, so even a random-init tiny byte-level model gets a graded signal.
"""

from __future__ import annotations

import random
import string

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trace_rl.data.trace import Message, Trace
from trace_rl.envs.base import Environment, Example, Sampler
from trace_rl.envs.registry import register_env
from trace_rl.envs.similarity import similarity


class ReverseTextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_length: int = Field(3, ge=1)
    max_length: int = Field(6, ge=1)
    alphabet: str = Field(string.ascii_lowercase, min_length=1)
    prompt: str = Field("reverse: {text}", description="the user message; {text} is the string to reverse")
    system_prompt: str | None = None

    @model_validator(mode="after")
    def _lengths(self) -> ReverseTextOptions:
        if self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} > max_length {self.max_length}")
        return self


@register_env("reverse-text")
class ReverseText(Environment):
    Options = ReverseTextOptions

    def make_example(self, rng: random.Random) -> dict:
        length = rng.randint(self.args.min_length, self.args.max_length)
        text = "".join(rng.choice(self.args.alphabet) for _ in range(length))
        return {"text": text, "answer": text[::-1]}

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        messages = [Message(role="user", content=self.args.prompt.format(text=example.data["text"]))]
        if self.args.system_prompt:
            messages.insert(0, Message(role="system", content=self.args.system_prompt))
        conversation = sampler.conversation(messages)
        completion = (await conversation.sample()).strip()
        answer = example.data["answer"]
        score = similarity(completion, answer)
        return [self.trace(
            example, conversation, reward=score, rewards={"similarity": score},
            metrics={
                "exact": float(completion == answer),
                "truncated": float(conversation.last_finish_reason == "length"),
            },
            info={"answer": answer},
        )]
