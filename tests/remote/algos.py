"""The test-only env module the env server imports (`--allow tests.remote.algos`): one env and the
algorithms the remote tests run on the server's side of the boundary."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from trace_rl.algorithms.base import Algorithm
from trace_rl.algorithms.distill import OPD
from trace_rl.algorithms.registry import register_algorithm
from trace_rl.envs.registry import register_env
from trace_rl.envs.reverse_text import ReverseText


@register_env("remote-reverse-text")
class RemoteReverseText(ReverseText):
    """reverse-text under another id: an env that only the env server's module registers."""


def sampled_mask(branch) -> np.ndarray:
    """The sampled tokens, token 0 excluded."""
    return branch.sampled & (np.arange(len(branch)) > 0)


def position_values(length: int, scale: float) -> np.ndarray:
    """The known signal: scale * (t + 1) at token t."""
    return (scale * np.arange(1, length + 1)).astype(np.float32)


class PositionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = 0.25


@register_algorithm("position_signal")
class PositionSignal(Algorithm):
    """rl values scale * (t + 1) on every branch of ok traces (masked to the sampled tokens); others left alone."""

    loss = "rl"
    Options = PositionOptions

    async def advantage(self, traces):
        for trace in traces:
            if trace.ok:
                for branch in trace.branches:
                    branch.mask = sampled_mask(branch)
                    branch.advantages = position_values(len(branch), self.options.scale)


@register_algorithm("remote_opd")
class RemoteOPD(OPD):
    """The builtin opd, env-owned: it scores with the model its runtime config describes, on the server."""


class SlowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sleep_s: float
    marker: str  # a file: the first request creates it and sleeps, later ones answer at once


@register_algorithm("slow_once")
class SlowOnce(Algorithm):
    loss = "ce"
    Options = SlowOptions

    async def advantage(self, traces):
        marker = Path(self.options.marker)
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            await asyncio.sleep(self.options.sleep_s)
        for trace in traces:
            for branch in trace.branches:
                branch.mask = sampled_mask(branch)
                branch.advantages = np.full(len(branch), 2.0, np.float32)


@register_algorithm("one_short")
class OneShort(Algorithm):
    """A broken env algorithm: its values on the second trace's branch miss the last token."""

    loss = "ce"

    async def advantage(self, traces):
        for trace in traces:
            for branch in trace.branches:
                branch.mask = sampled_mask(branch)
                branch.advantages = np.ones(len(branch), np.float32)
        broken = traces[1].branches[0]
        broken.advantages = broken.advantages[:-1]


@register_algorithm("step_centred")
class StepCentred(Algorithm):
    """A_i = r_i - mean of the rewards of every ok trace in the call: a batch-level statistic (`whole_step`)."""

    loss = "rl"
    whole_step = True

    async def advantage(self, traces):
        ok = [trace for trace in traces if trace.ok]
        mean = float(np.mean([trace.reward for trace in ok])) if ok else 0.0
        for trace in ok:
            for branch in trace.branches:
                branch.mask = sampled_mask(branch)
                branch.advantages = branch.mask * np.float32(trace.reward - mean)
