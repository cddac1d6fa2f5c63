"""Channel aggregation: per-branch channels of all algorithms -> one TrainingSample per trained branch.

For each loss, the channels of that loss on a branch combine as
    values = sum_c values_c * mask_c,    mask = OR_c mask_c,
so `[grpo, opd]` trains on (r - mean) + (ref - behaviour). A loss no algorithm produced
is all-zero/False. A branch becomes a sample when at least one of its tokens is masked.
Run `validate_channels` first: aggregation assumes every channel fits its branch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from trace_rl.data.channel import Channel
from trace_rl.data.sample import TrainingSample
from trace_rl.data.trace import Trace


def combine(channels: Sequence[Channel], tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """values = sum_c values_c * mask_c (0 outside every mask), mask = OR_c mask_c."""
    if not channels:
        return np.zeros(tokens, np.float32), np.zeros(tokens, np.bool_)
    values = channels[0].values * channels[0].mask
    mask = channels[0].mask
    for channel in channels[1:]:
        values += channel.values * channel.mask
        mask = mask | channel.mask
    return (values if values.dtype == np.float32 else values.astype(np.float32)), mask


def sum_channels(traces: list[Trace], channels: list[Channel]) -> list[TrainingSample]:
    """One sample per branch with at least one masked token, in trace and branch order.

    A loss with a single channel shares that channel's mask array with the sample.
    """
    by_branch_loss: dict[tuple[str, int, str], list[Channel]] = defaultdict(list)
    for channel in channels:
        by_branch_loss[(channel.trace_id, channel.branch_index, channel.loss)].append(channel)
    samples = []
    for trace in traces:
        for branch in trace.branches:
            tokens = len(branch.token_ids)
            rl_values, rl_mask = combine(by_branch_loss.get((trace.id, branch.index, "rl"), ()), tokens)
            ce_values, ce_mask = combine(by_branch_loss.get((trace.id, branch.index, "ce"), ()), tokens)
            if np.count_nonzero(rl_mask) or np.count_nonzero(ce_mask):
                samples.append(TrainingSample(
                    trace_id=trace.id, branch_index=branch.index, env=trace.env, input_ids=branch.token_ids,
                    temperature=branch.temperature, sampled=branch.sampled, inference_logprobs=branch.logprobs,
                    rl_values=rl_values, rl_mask=rl_mask, ce_values=ce_values, ce_mask=ce_mask,
                    policy_versions=branch.versions_or(trace.policy_step),
                ))
    return samples


def channel_stats(channels: list[Channel]) -> dict[str, float]:
    """Per algorithm id: branches it annotated, tokens it masked, and mean/min/max of its masked values.

    Keys are `channel/<algorithm id>/<stat>`; the value stats are 0 when nothing was masked.
    """
    by_algorithm: dict[str, list[Channel]] = defaultdict(list)
    for channel in channels:
        by_algorithm[channel.algorithm_id].append(channel)
    stats: dict[str, float] = {}
    for algorithm_id, group in by_algorithm.items():
        masked = np.concatenate([c.values[c.mask] for c in group]).astype(np.float64)
        prefix = f"channel/{algorithm_id}"
        stats[f"{prefix}/branches"] = float(len(group))
        stats[f"{prefix}/tokens"] = float(masked.size)
        stats[f"{prefix}/mean"] = float(masked.mean()) if masked.size else 0.0
        stats[f"{prefix}/min"] = float(masked.min()) if masked.size else 0.0
        stats[f"{prefix}/max"] = float(masked.max()) if masked.size else 0.0
    return stats
