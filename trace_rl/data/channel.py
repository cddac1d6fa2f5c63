"""A channel: what one algorithm set on one branch (`(algorithm id, loss, values, mask)`).

The algorithm runner makes one per branch an algorithm trained; channels of the same loss are summed
into one training sample later (`trace_rl.pipeline.channels.sum_channels`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class Channel:
    """What one algorithm set on one branch: per-token `values` (float32) and `mask` (bool)."""

    algorithm_id: str
    loss: str
    trace_id: str
    branch_index: int
    values: np.ndarray
    mask: np.ndarray

    def __repr__(self) -> str:
        # short on purpose: Python 3.11's asyncio.run formats its main task, result included, on exit
        return (
            f"Channel({self.algorithm_id!r}, {self.loss!r}, trace {self.trace_id!r} branch {self.branch_index}, "
            f"{int(np.count_nonzero(self.mask))}/{len(self.mask)} tokens masked)"
        )
