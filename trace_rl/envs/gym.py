"""`reasoning-gym`: procedural reasoning tasks of the `reasoning-gym` package (`pip install 'trace-rl[gym]'`).

`task` names one of its datasets (`basic_arithmetic`, `leg_counting`, ...) and `options` are that
dataset's own config keys. A step's examples are a fresh dataset of `batch_size` items generated with
the seed the rollout loop derives from (run seed, step, env index), so a run sees the same problems
for the same seed. The reply's answer is the text inside `<answer>...</answer>` (the whole reply
when there is no such tag), scored by the task's own `score_answer`, in [0, 1].
"""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trace_rl.data.trace import Message, Trace
from trace_rl.envs.base import EnvError, Environment, Example, Sampler
from trace_rl.envs.registry import register_env

SYSTEM_PROMPT = ("Answer the question. Think step by step if you need to, then give only the final answer as "
                 "<answer>answer here</answer>.")


class GymOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str = Field(..., description="a reasoning-gym dataset name, e.g. 'basic_arithmetic'")
    options: dict[str, Any] = Field(default_factory=dict, description="the dataset's own config keys")
    system_prompt: str | None = SYSTEM_PROMPT


@functools.lru_cache(maxsize=64)
def generate(task: str, options_json: str, seed: int, size: int):
    """The task's dataset of `size` items for `seed` (cached: a step's rollouts score against the same one)."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise EnvError("env 'reasoning-gym' needs the reasoning-gym package; pip install 'trace-rl[gym]'")
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(options_json))
    except (ValueError, TypeError, AssertionError) as exc:
        raise EnvError(f"reasoning-gym task {task!r} with options {options_json}: {exc}") from None


def reply_answer(reply: str) -> str:
    """The text inside the last <answer>...</answer>, else the whole reply, stripped."""
    if "<answer>" in reply:
        return reply.rsplit("<answer>", 1)[1].split("</answer>", 1)[0].strip()
    return reply.strip()


@register_env("reasoning-gym")
class ReasoningGym(Environment):
    Options = GymOptions

    @classmethod
    def check_config(cls, options: GymOptions) -> list[str]:
        try:
            generate(options.task, json.dumps(options.options, sort_keys=True), 0, 1)
        except EnvError as exc:
            return [str(exc)]
        return []

    def dataset(self, seed: int, size: int):
        return generate(self.args.task, json.dumps(self.args.options, sort_keys=True), seed, size)

    def examples(self, seed: int, count: int) -> list[Example]:
        dataset = self.dataset(seed, count)
        return [Example(id=f"{seed:x}-{i}", data={"seed": seed, "size": count, "index": i,
                                                  "question": dataset[i]["question"], "answer": dataset[i]["answer"]})
                for i in range(count)]

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        data = example.data
        messages = [Message(role="user", content=data["question"])]
        if self.args.system_prompt:
            messages.insert(0, Message(role="system", content=self.args.system_prompt))
        conversation = sampler.conversation(messages)
        reply = await conversation.sample()
        dataset = self.dataset(data["seed"], data["size"])
        score = float(dataset.score_answer(answer=reply_answer(reply), entry=dataset[data["index"]]))
        return [self.trace(example, conversation, reward=score, rewards={"score": score},
                           metrics={"truncated": float(conversation.last_finish_reason == "length")},
                           info={"answer": str(data["answer"])})]
