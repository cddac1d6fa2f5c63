"""Third-party code loaded by import path in the tests: echo filters and an algorithm."""

from __future__ import annotations

import numpy as np

from trace_rl.algorithms.base import Algorithm


def from_position(trace, start):
    """Keep tokens at positions >= start."""
    return [np.arange(len(b)) >= start for b in trace.branches]


def keep_everything(trace):
    return [np.ones(len(b), bool) for b in trace.branches]


def too_short(trace):
    return [np.ones(len(b) - 1, bool) for b in trace.branches]


def integer_masks(trace):
    return [np.ones(len(b), np.int64) for b in trace.branches]


def one_mask_only(trace):
    return np.ones(len(trace.branches[0]), bool)


class LastTokenBonus(Algorithm):
    """A third-party algorithm: ce weight 2.0 on each branch's last token."""

    loss = "ce"

    async def advantage(self, traces):
        for trace in traces:
            for branch in trace.branches:
                branch.mask = np.arange(len(branch)) == len(branch) - 1
                branch.advantages = branch.mask * np.float32(2.0)


class HalfAnnotated(Algorithm):
    """A broken algorithm: sets advantages but forgets the mask."""

    async def advantage(self, traces):
        traces[0].branches[0].advantages = np.zeros(len(traces[0].branches[0]), np.float32)
