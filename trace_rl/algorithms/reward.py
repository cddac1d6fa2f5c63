"""Reward-based advantages: one scalar per trace, spread over its sampled tokens (loss `rl`)."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trace_rl.algorithms.base import Algorithm, AlgorithmError
from trace_rl.options import NoOptions
from trace_rl.algorithms.registry import ALGORITHMS, register_algorithm
from trace_rl.algorithms.signal import ok_traces, sampled_mask, set_on_sampled
from trace_rl.data.trace import Trace

StdKind = Literal["unbiased", "population"]


def set_trace_advantages(traces: list[Trace], advantages: np.ndarray) -> None:
    for trace, advantage in zip(traces, advantages, strict=True):
        for branch in trace.branches:
            set_on_sampled(branch, advantage)


def spread(rewards: np.ndarray, std: StdKind) -> float:
    """The standard deviation of `rewards`: `unbiased` divides the squared deviations by n - 1 (torch's default,
    TRL's `scale_rewards` and verl's `compute_grpo_outcome_advantage`), `population` by n (numpy's default; trace-rl's
    before 2026-11-25). A single reward has no spread: 0."""
    if len(rewards) < 2:
        return 0.0
    return float(rewards.std(ddof=1 if std == "unbiased" else 0))


def group_relative(rewards: np.ndarray, std_normalize: bool, std: StdKind = "unbiased") -> np.ndarray:
    """GRPO (arXiv 2402.03300): A_i = r_i - mean(r), or (r_i - mean(r)) / (spread(r) + 1e-6); a group of one gives 0."""
    centered = rewards - rewards.mean()
    return centered / (spread(rewards, std) + 1e-6) if std_normalize else centered


def leave_one_out(rewards: np.ndarray) -> np.ndarray:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740): A_i = r_i - mean_{j != i} r_j.

    The same as `G / (G - 1) * (r_i - mean(r))` for a group of G; a group of one gives 0.
    """
    if len(rewards) < 2:
        return np.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (len(rewards) - 1)


def whitened(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """`(x - mean) / sqrt(var + 1e-8)` with each value counted `weights` times (its rl tokens), var unbiased:
    verl's `masked_whiten` over the step's tokens. Fewer than 2 tokens: only centred."""
    n = weights.sum()
    if n == 0:
        return np.zeros_like(values)
    mean = (weights * values).sum() / n
    if n < 2:
        return values - mean
    var = (weights * (values - mean) ** 2).sum() / (n - 1)
    return (values - mean) / np.sqrt(var + 1e-8)


def overlong_penalty(length: np.ndarray, max_tokens: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), per trace of L sampled tokens:

        0 if L <= max_tokens - buffer;  ((max_tokens - buffer) - L) / buffer within the buffer;  -1 beyond max_tokens
    """
    return np.clip(((max_tokens - buffer) - length) / buffer, -1.0, 0.0)


def max_likelihood_normalized(rewards: np.ndarray) -> np.ndarray:
    """MaxRL (arXiv 2602.02710): A_i = (r_i - mu) / mu if mu > 0 else 0, with mu = mean(r)."""
    mu = rewards.mean()
    return (rewards - mu) / mu if mu > 0 else np.zeros_like(rewards)


def seat_groups(traces: list[Trace]) -> list[list[Trace]]:
    """The traces by (group, agent), in first-seen order: what a group baseline compares. Each seat of a
    several-agent env gets its own baseline: the two seats of a zero-sum game, pooled, would always average 0 and
    leave every advantage the raw payoff. A single-agent env's are its groups."""
    seats: dict[tuple[str, str], list[Trace]] = {}
    for trace in traces:
        seats.setdefault((trace.group_id, trace.agent), []).append(trace)
    return list(seats.values())


class GroupBaseline(Algorithm):
    """An algorithm whose baseline is the mean of the group, per seat (`seat_groups`): a group of one rollout gets
    advantage 0 everywhere."""

    @classmethod
    def check_config(cls, options: BaseModel, run_config: Any) -> list[str]:
        ids = {key for key, registered in ALGORITHMS.items() if registered is cls}
        return [f"env.{index}.group_size = 1: a group of one rollout has advantage 0 on every trace; set "
                f"env.{index}.group_size to 2 or more, or use 'rl'"
                for index, env in enumerate(run_config.env)
                if env.group_size == 1 and any(a.id in ids for a in run_config.algorithms_for(env))]


class Overlong(BaseModel):
    """DAPO's overlong reward shaping: `r += factor * overlong_penalty(L, max_tokens, buffer)`."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(..., gt=0, description="L_max: the length (sampled tokens of the trace) punished by -1")
    buffer: int = Field(..., gt=0, description="L_buf: the penalty grows linearly over the last `buffer` tokens")
    factor: float = Field(1.0, ge=0, description="the weight of the penalty")

    @model_validator(mode="after")
    def _buffer_fits(self) -> Overlong:
        if self.buffer > self.max_tokens:
            raise ValueError(f"overlong.buffer = {self.buffer} exceeds overlong.max_tokens = {self.max_tokens}")
        return self


class RewardOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    overlong: Overlong | None = None


def sampled_tokens(trace: Trace) -> int:
    """L: the tokens the actor sampled in the trace (all its branches; token 0 never counts)."""
    return int(sum(sampled_mask(branch).sum() for branch in trace.branches))


def shaped_rewards(traces: list[Trace], options: RewardOptions) -> np.ndarray:
    """The traces' rewards, plus DAPO's overlong penalty when `overlong` is set."""
    rewards = np.array([t.reward for t in traces], np.float64)
    if options.overlong is not None:
        o = options.overlong
        lengths = np.array([sampled_tokens(t) for t in traces], np.float64)
        rewards = rewards + o.factor * overlong_penalty(lengths, o.max_tokens, o.buffer)
    return rewards


class GRPOOptions(RewardOptions):
    std_normalize: bool | None = None
    scale: Literal["group", "batch", "none"] | None = None
    std: StdKind = "unbiased"

    @model_validator(mode="after")
    def _one_scale(self) -> GRPOOptions:
        if self.std_normalize is not None and self.scale is not None:
            raise ValueError("std_normalize is the older spelling of scale (true: 'group', false: 'none'); set "
                             "only scale")
        return self

    @property
    def scale_mode(self) -> str:
        if self.scale is not None:
            return self.scale
        return "group" if self.std_normalize else "none"


@register_algorithm("grpo")
class GRPO(GroupBaseline):
    """A_i = (r_i - mean_group(r)) / scale on trace i's sampled tokens, the group being one task's traces of one
    seat (`seat_groups`).

    `scale`: `none` (the default; Dr. GRPO, arXiv 2503.20783) divides by 1; `group` by the group's
    std + 1e-6 (GRPO, arXiv 2402.03300; `std_normalize = true`); `batch` by the std of the whole
    step's rewards + 1e-6 (Liu et al. 2025, arXiv 2508.08221). `std`: `unbiased` (the default, as TRL and
    verl) or `population` (`spread`). The mean and stds are over ok traces only: errored and untrainable
    traces get no signal and do not shift them.
    """

    loss = "rl"
    Options = GRPOOptions

    @property
    def whole_step(self) -> bool:
        return self.options.scale_mode == "batch"

    async def advantage(self, traces: list[Trace]) -> None:
        traces = ok_traces(traces)
        if not traces:
            return
        mode = self.options.scale_mode
        step_std = spread(shaped_rewards(traces, self.options), self.options.std) if mode == "batch" else 0.0
        for seat in seat_groups(traces):
            rewards = shaped_rewards(seat, self.options)
            if mode == "batch":
                set_trace_advantages(seat, (rewards - rewards.mean()) / (step_std + 1e-6))
            else:
                set_trace_advantages(seat, group_relative(rewards, mode == "group", self.options.std))


@register_algorithm("rloo")
class RLOO(GroupBaseline):
    """A_i = r_i - mean_{j != i} r_j over the ok traces of the group's seat (`leave_one_out`, `seat_groups`)."""

    loss = "rl"
    Options = RewardOptions

    async def advantage(self, traces: list[Trace]) -> None:
        for seat in seat_groups(ok_traces(traces)):
            set_trace_advantages(seat, leave_one_out(shaped_rewards(seat, self.options)))


@register_algorithm("reinforce_pp")
class ReinforcePlusPlus(GroupBaseline):
    """REINFORCE++ with the group-mean baseline (Hu 2025, arXiv 2501.03262; verl's reinforce_plus_plus_baseline):
    A_i = r_i - mean_group(r) (per seat, `seat_groups`), then whitened over the step's rl tokens (`whitened`, each
    trace counted once per sampled token). It needs the whole step (`whole_step`)."""

    loss = "rl"
    Options = RewardOptions
    whole_step = True

    async def advantage(self, traces: list[Trace]) -> None:
        traces = ok_traces(traces)
        if not traces:
            return
        seats = seat_groups(traces)
        ordered = [t for seat in seats for t in seat]
        centred = np.concatenate([group_relative(shaped_rewards(seat, self.options), False) for seat in seats])
        tokens = np.array([sampled_tokens(t) for t in ordered], np.float64)
        set_trace_advantages(ordered, whitened(centred, tokens))


@register_algorithm("max_rl")
class MaxRL(GroupBaseline):
    """A_i = (r_i - mu) / mu when mu > 0, else 0; mu the mean reward of the ok traces of the group's seat.

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
        for seat in seat_groups(traces):
            set_trace_advantages(seat, max_likelihood_normalized(np.array([t.reward for t in seat], np.float64)))


@register_algorithm("rl")
class REINFORCE(Algorithm):
    """Plain REINFORCE (Williams 1992): A_i = r_i on trace i's sampled tokens."""

    loss = "rl"
    Options = RewardOptions

    async def advantage(self, traces: list[Trace]) -> None:
        traces = ok_traces(traces)
        set_trace_advantages(traces, shaped_rewards(traces, self.options))
