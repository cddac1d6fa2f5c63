"""Shared building blocks of the builtins: which traces and tokens they may train.

Every builtin trains only `trace.ok` traces (trainable and error-free) and never
masks token 0, whose logprob does not exist (nothing precedes it).
"""

from __future__ import annotations

import numpy as np

from trace_rl.data.trace import Branch, Trace


def ok_traces(traces: list[Trace]) -> list[Trace]:
    return [trace for trace in traces if trace.ok]


def sampled_mask(branch: Branch) -> np.ndarray:
    """The tokens the actor sampled, token 0 excluded."""
    mask = branch.sampled.copy()
    if len(mask):
        mask[0] = False
    return mask


def set_on_sampled(branch: Branch, values: float | np.ndarray) -> None:
    """Annotate the sampled tokens with `values` (a scalar or one value per token); 0 elsewhere."""
    mask = sampled_mask(branch)
    branch.mask = mask
    branch.advantages = mask * np.asarray(values, np.float32)
