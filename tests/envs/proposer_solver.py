"""A small proposer-solver env for hierarchical_grpo: the proposer's reply sets a length target, `solvers` plays of
one `solver` agent each try to reply at least that long.

The target is the proposer's reply length in characters mod 7, plus 1; a solver scores 1 when its reply is at least
that long. The proposer scores the problem's learnability 4 p (1 - p), p its solvers' solve rate (as verifiers'
proposer_solver env): a problem every solver or no solver solves teaches nothing.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from trace_rl.data.trace import Message, Trace
from trace_rl.envs.base import Environment, Example, Sampler


class ProposerSolverOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    solvers: int = Field(3, ge=1, description="solver plays per proposed problem")


def target_length(proposal: str) -> int:
    return len(proposal) % 7 + 1


class ProposerSolver(Environment):
    Options = ProposerSolverOptions

    def make_example(self, rng: random.Random) -> dict:
        return {"topic": rng.choice(["ships", "birds", "clocks"])}

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        topic = example.data["topic"]
        proposer = sampler.conversation([Message(role="user", content=f"Propose a problem about {topic}.")])
        target = target_length(await proposer.sample())
        solvers = [sampler.conversation([Message(role="user", content=f"Write at least {target} characters.")],
                                        agent=play + 1) for play in range(self.args.solvers)]
        solved = [float(len(await solver.sample()) >= target) for solver in solvers]
        p = sum(solved) / len(solved)
        return [self.trace(example, proposer, agent="proposer", reward=4 * p * (1 - p), info={"target": target}),
                *(self.trace(example, solver, agent="solver", reward=reward, info={"target": target})
                  for solver, reward in zip(solvers, solved))]
