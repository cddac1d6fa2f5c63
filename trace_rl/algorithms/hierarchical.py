"""Hierarchical GRPO: group baselines for proposer-solver envs, per role and, for the solvers, per proposed problem."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from trace_rl.algorithms.base import Algorithm, AlgorithmError
from trace_rl.algorithms.registry import register_algorithm
from trace_rl.algorithms.reward import set_trace_advantages
from trace_rl.algorithms.signal import ok_traces
from trace_rl.data.trace import Trace, rollout_of


class HierarchicalGRPOOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    episode_agents: list[str] = Field(
        ..., min_length=1, description="the agents compared only within one rollout (the solvers of one proposed "
        "problem); every other agent is compared with its own plays across the group")


@register_algorithm("hierarchical_grpo")
class HierarchicalGRPO(Algorithm):
    """A_i = r_i - mean_{j in P(i)} r_j on trace i's sampled tokens, over ok traces, where the peers P(i) are

        P(i) = the traces of agent(i) in rollout(i)   if agent(i) is in `episode_agents` (a solver: the attempts at
                                                        the same proposed problem)
        P(i) = the traces of agent(i) in the group     otherwise (a proposer: the other proposals from one task)

    A peer set of one gives 0. One rollout of a proposer-solver env is one proposed problem: the proposer's trace
    and its solvers' (one agent played several times, `trace_rl.data.trace.rollout_trace_id`); a group is
    `group_size` proposals from one source task. Rewards are not scaled.

    Source: prime-rl's `hierarchical_grpo` (PrimeIntellect-ai/prime-rl, main, 2026: the
    `HierarchicalGRPOAlgorithm.score_group` estimator and docs/algorithms.md "Hierarchical GRPO"), whose
    `episode_agents` lists the roles compared within one episode.
    """

    loss = "rl"
    Options = HierarchicalGRPOOptions

    async def advantage(self, traces: list[Trace]) -> None:
        episode_agents = set(self.options.episode_agents)
        peers: dict[tuple[str, str, str | None], list[Trace]] = {}
        for trace in ok_traces(traces):
            rollout = None
            if trace.agent in episode_agents:
                rollout = rollout_of(trace)
                if rollout is None:
                    raise AlgorithmError(
                        f"hierarchical_grpo: trace {trace.id!r} has no rollout in its id (`<group_id>-r<rollout>-"
                        "<agent>`, as the rollout loop names traces), so its episode peers are unknown; use grpo")
            peers.setdefault((trace.group_id, trace.agent, rollout), []).append(trace)
        for members in peers.values():
            rewards = np.array([t.reward for t in members], np.float64)
            set_trace_advantages(members, rewards - rewards.mean())
