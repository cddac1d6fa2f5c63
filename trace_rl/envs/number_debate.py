"""`number-debate`: a two-agent game. Two players debate a small sum; a scripted judge decides.

Both players get the question; in each round player_a speaks, then player_b, each seeing the
other's last reply as a user message. The judge reads the last integer of each player's final
reply: a correct player beats a wrong one (1 vs 0), and equal verdicts tie (0.5 each).
One trace per player; only the `learner` seat (or both) is trainable.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trace_rl.data.trace import Message, Trace
from trace_rl.envs.base import Environment, Example, Sampler
from trace_rl.envs.registry import register_env

SEATS = ("player_a", "player_b")
INTEGER = re.compile(r"-?\d+")


class NumberDebateOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rounds: int = Field(2, ge=1)
    max_operand: int = Field(9, ge=1)
    learner: Literal["player_a", "player_b", "both"] = Field("player_a", description="the seat(s) to train")


def final_number(text: str) -> int | None:
    found = INTEGER.findall(text)
    return int(found[-1]) if found else None


def judge(correct: list[bool]) -> list[float]:
    """Rewards of the two players from whether each final answer is correct."""
    if correct[0] == correct[1]:
        return [0.5, 0.5]
    return [float(c) for c in correct]


@register_env("number-debate")
class NumberDebate(Environment):
    Options = NumberDebateOptions

    def make_example(self, rng: random.Random) -> dict:
        a, b = rng.randint(0, self.args.max_operand), rng.randint(0, self.args.max_operand)
        return {"question": f"What is {a} + {b}?", "answer": a + b}

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        question = example.data["question"]
        players = [
            sampler.conversation(
                [Message(role="system", content=f"You are {seat} in a debate. End your reply with a number."),
                 Message(role="user", content=f"Question: {question}")],
                agent=seat_index,
            )
            for seat_index, seat in enumerate(SEATS)
        ]
        replies = ["", ""]
        for round_index in range(self.args.rounds):
            for seat_index, conversation in enumerate(players):
                other = 1 - seat_index
                if round_index or seat_index:
                    conversation.add(Message(role="user", content=f"{SEATS[other]} says: {replies[other]}"))
                replies[seat_index] = await conversation.sample()
        numbers = [final_number(reply) for reply in replies]
        correct = [number == example.data["answer"] for number in numbers]
        rewards = judge(correct)
        return [
            self.trace(
                example, players[i], agent=seat, trainable=self.args.learner in (seat, "both"), reward=rewards[i],
                rewards={"correct": float(correct[i]), "won": float(rewards[i] == 1.0)},
                info={"answer": example.data["answer"], "final_answer": numbers[i]},
            )
            for i, seat in enumerate(SEATS)
        ]
