"""`alphabet-sort`: multi-turn. Sort a few names, then sort again with more names added.

Turn 1 asks for the names sorted, one per line. Every later turn is a user message with
feedback on the previous answer and the names to add; the model sorts the whole list again.
Each turn scores difflib's similarity ratio of the answered lines to the sorted list; the
reward is the mean over turns (`rewards.turn_<n>` holds each).
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trace_rl.data.trace import Message, Trace
from trace_rl.envs.base import Environment, Example, Sampler
from trace_rl.envs.registry import register_env
from trace_rl.envs.similarity import similarity

NAMES = (
    "Ada", "Alan", "Ann", "Ben", "Bea", "Cal", "Cleo", "Dan", "Dora", "Eli", "Emma", "Finn", "Faye", "Gus", "Gia",
    "Hal", "Hana", "Ian", "Iris", "Jack", "Jade", "Kai", "Kim", "Leo", "Lily", "Max", "Mia", "Ned", "Nora", "Otto",
    "Olga", "Paul", "Pia", "Quin", "Rae", "Ray", "Sam", "Sara", "Ted", "Tess", "Uma", "Ugo", "Vic", "Vera", "Walt",
    "Wren", "Xan", "Yara", "Yuri", "Zed", "Zoe",
)


class AlphabetSortOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    turns: int = Field(2, ge=2, description="sorting turns; every turn after the first adds names")
    first_names: int = Field(3, ge=1, description="names in the first turn")
    added_names: int = Field(2, ge=1, description="names added in each later turn")
    system_prompt: str | None = None

    @model_validator(mode="after")
    def _enough_names(self) -> AlphabetSortOptions:
        needed = self.first_names + self.added_names * (self.turns - 1)
        if needed > len(NAMES):
            raise ValueError(f"needs {needed} distinct names, only {len(NAMES)} exist; use fewer turns or names")
        return self


def answer_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


@register_env("alphabet-sort")
class AlphabetSort(Environment):
    Options = AlphabetSortOptions

    def make_example(self, rng: random.Random) -> dict:
        args = self.args
        names = rng.sample(NAMES, args.first_names + args.added_names * (args.turns - 1))
        batches = [names[: args.first_names]]
        batches += [names[args.first_names + i * args.added_names:][: args.added_names] for i in range(args.turns - 1)]
        return {"batches": batches}

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        batches = example.data["batches"]
        request = "Sort these names alphabetically, one per line:\n" + "\n".join(batches[0])
        messages = [Message(role="user", content=request)]
        if self.args.system_prompt:
            messages.insert(0, Message(role="system", content=self.args.system_prompt))
        conversation = sampler.conversation(messages)
        seen: list[str] = []
        scores: list[float] = []
        for turn, batch in enumerate(batches):
            if turn:
                verdict = "correct" if scores[-1] == 1.0 else f"not quite right (score {scores[-1]:.2f})"
                conversation.add(Message(
                    role="user",
                    content=f"Your list was {verdict}. Now add these names and sort the whole list again:\n"
                    + "\n".join(batch),
                ))
            seen += batch
            scores.append(similarity(answer_lines(await conversation.sample()), sorted(seen)))
        rewards = {f"turn_{i + 1}": s for i, s in enumerate(scores)}
        return [self.trace(
            example, conversation, reward=sum(scores) / len(scores), rewards=rewards,
            metrics={"exact_turns": float(sum(s == 1.0 for s in scores))},
            info={"answer": "\n".join(sorted(seen))},
        )]
