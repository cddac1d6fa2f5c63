"""Reward-based advantages: one scalar per trace, spread over its sampled tokens (loss `rl`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from trace_rl.algorithms.base import REGISTRY, Algorithm, AlgorithmError, NoOptions, register
from trace_rl.algorithms.signal import ok_traces, set_on_sampled
from trace_rl.trace import Trace


def set_trace_advantages(traces: list[Trace], advantages: np.ndarray) -> None:
    for trace, advantage in zip(traces, advantages, strict=True):
        for branch in trace.branches:
            set_on_sampled(branch, advantage)


def group_relative(rewards: np.ndarray, std_normalize: bool) -> np.ndarray:
    """GRPO (arXiv 2402.03300): A_i = r_i - mean(r), or (r_i - mean(r)) / (std(r) + 1e-6).

    `std` is the population standard deviation of the group; a group of one gives 0.
    """
    centered = rewards - rewards.mean()
    return centered / (rewards.std() + 1e-6) if std_normalize else centered


def max_likelihood_normalized(rewards: np.ndarray) -> np.ndarray:
    """MaxRL (arXiv 2602.02710): A_i = (r_i - mu) / mu if mu > 0 else 0, with mu = mean(r)."""
    mu = rewards.mean()
    return (rewards - mu) / mu if mu > 0 else np.zeros_like(rewards)


class GroupBaseline(Algorithm):
    """An algorithm whose baseline is the mean of the group: a group of one rollout gets advantage 0 everywhere."""

    @classmethod
    def check_config(cls, options: BaseModel, run_config: Any) -> list[str]:
        ids = {key for key, registered in REGISTRY.items() if registered is cls}
        return [f"env.{index}.group_size = 1: a group of one rollout has advantage 0 on every trace; set "
                f"env.{index}.group_size to 2 or more, or use 'rl'"
                for index, env in enumerate(run_config.env)
                if env.group_size == 1 and any(a.id in ids for a in run_config.algorithms_for(env))]


class GRPOOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    std_normalize: bool = False


@register("grpo")
class GRPO(GroupBaseline):
    """A_i = r_i - mean_group(r) on trace i's sampled tokens (`std_normalize`: divided by std + 1e-6).

    The mean is over the group's ok traces only: errored and untrainable traces get no
    signal and do not shift the baseline.
    """

    loss = "rl"
    Options = GRPOOptions

    async def advantage(self, traces: list[Trace]) -> None:
        traces = ok_traces(traces)
        if traces:
            rewards = np.array([t.reward for t in traces], np.float64)
            set_trace_advantages(traces, group_relative(rewards, self.options.std_normalize))


@register("max_rl")
class MaxRL(GroupBaseline):
    """A_i = (r_i - mu) / mu when mu > 0, else 0; mu the mean reward of the group's ok traces.

    Rewards must be non-negative (they are read as success probabilities).
    """

    loss = "rl"
    Options = NoOptions

    async def advantage(self, traces: list[Trace]) -> None:
        traces = ok_traces(traces)
        for trace in traces:
            if trace.reward < 0:
                raise AlgorithmError(
                    f"max_rl needs non-negative rewards, but trace {trace.id!r} (env {trace.env!r}) has reward "
                    f"{trace.reward}; use grpo or rl for signed rewards"
                )
        if traces:
            rewards = np.array([t.reward for t in traces], np.float64)
            set_trace_advantages(traces, max_likelihood_normalized(rewards))


@register("rl")
class REINFORCE(Algorithm):
    """Plain REINFORCE (Williams 1992): A_i = r_i on trace i's sampled tokens."""

    loss = "rl"
    Options = NoOptions

    async def advantage(self, traces: list[Trace]) -> None:
        traces = ok_traces(traces)
        set_trace_advantages(traces, np.array([t.reward for t in traces], np.float64))
