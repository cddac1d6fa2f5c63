"""A training sample: one trained branch's tokens with its aggregated per-loss channels, what the trainer
reads (one row of `batch.parquet`).

`SAMPLE_ARRAYS` names the sample's per-token arrays, as the batch's columns are named, with their dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trace_rl.names import LOSS_NAMES


@dataclass(eq=False)
class TrainingSample:
    """One row of batch.parquet: a branch's tokens with its aggregated per-loss channels."""

    trace_id: str
    branch_index: int
    env: str
    input_ids: np.ndarray
    temperature: float
    sampled: np.ndarray  # bool per token: produced by the sampler (at `temperature`); else prompt/observation (at 1)
    inference_logprobs: np.ndarray
    rl_values: np.ndarray
    rl_mask: np.ndarray
    ce_values: np.ndarray
    ce_mask: np.ndarray
    # the [trainer.loss.kl] reference's logprobs of `input_ids` (its first 0), scored at `temperature` on sampled
    # tokens; None without a KL penalty (the batch then has no such column)
    ref_logprobs: np.ndarray | None = None
    # int32 per token: the weights step that sampled it (-1: not sampled), as the branch records it
    # (trace_rl.data.trace); None for a sample built outside the pipeline (its batch then has no such column)
    policy_versions: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


SAMPLE_ARRAYS = {
    "input_ids": np.int32, "sampled": np.bool_, "inference_logprobs": np.float32, "ref_logprobs": np.float32,
    "policy_versions": np.int32,
    **{f"{loss}_{part}": (np.float32 if part == "values" else np.bool_) for loss in LOSS_NAMES
       for part in ("values", "mask")},
}
