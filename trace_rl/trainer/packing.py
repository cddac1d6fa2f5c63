"""Packing training samples into micro-batches of at most `trainer.micro_batch_tokens` tokens.

A micro-batch is one row of concatenated samples. Each sample keeps its own
position ids (0, 1, ...) and attends only to its own earlier tokens: the trainer
passes the sample bounds with the row (`trace_rl.trainer.varlen`), so attention
runs per sample instead of over a dense block-diagonal (T x T) mask. The first
token of a sample has no prediction (its logprob is 0 by convention), so any
mask there is dropped.

Each token's logits divisor (`MicroBatch.temperature`) is the sample's temperature on
tokens the sampler produced (`sampled`) and 1 on every other token (prompt, template,
user or tool observations): nothing sampled those, so their logprob is the model's own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from trace_rl.data.sample import TrainingSample
from trace_rl.names import LOSS_NAMES

CHANNEL_FIELDS = ("inference_logprobs", *(f"{loss}_{part}" for loss in LOSS_NAMES for part in ("values", "mask")))
TOKEN_FIELDS = ("input_ids", "sampled", *CHANNEL_FIELDS)


class PackingError(ValueError):
    pass


def sample_name(sample: TrainingSample) -> str:
    return f"trace {sample.trace_id!r} branch {sample.branch_index}"


def fit_to_limit(samples: list[TrainingSample], limit: int, truncate: bool) -> list[TrainingSample]:
    """Check every sample's arrays agree in length and fit in `limit` tokens; cut the too long ones if `truncate`."""
    fitted = []
    for sample in samples:
        fields = TOKEN_FIELDS if sample.ref_logprobs is None else (*TOKEN_FIELDS, "ref_logprobs")
        lengths = {name: len(getattr(sample, name)) for name in fields}
        if len(set(lengths.values())) != 1:
            raise PackingError(f"{sample_name(sample)}: per-token arrays differ in length: {lengths}")
        if len(sample) == 0:
            raise PackingError(f"{sample_name(sample)}: has no tokens")
        if len(sample) > limit:
            if not truncate:
                raise PackingError(
                    f"{sample_name(sample)} has {len(sample)} tokens, more than trainer.micro_batch_tokens = {limit}; "
                    "raise trainer.micro_batch_tokens or set trainer.truncate = true to cut it"
                )
            sample = dataclasses.replace(sample, **{name: getattr(sample, name)[:limit] for name in fields})
        fitted.append(sample)
    return fitted


def first_fit_decreasing(lengths: list[int], limit: int) -> list[list[int]]:
    """Bins of indices, longest item first, each into the first bin with room; every length <= limit."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(limit - lengths[i])
    return bins


@dataclass
class MicroBatch:
    """Concatenated per-token arrays of the samples packed in one row."""

    input_ids: np.ndarray  # int64
    position_ids: np.ndarray  # int64, restarting at 0 for each sample
    segment_ids: np.ndarray  # int64, which sample of the micro-batch each token belongs to
    temperature: np.ndarray  # float32, logits divisor predicting each token: the sample temperature if sampled, else 1
    inference_logprobs: np.ndarray
    rl_values: np.ndarray
    rl_mask: np.ndarray
    ce_values: np.ndarray
    ce_mask: np.ndarray
    ref_logprobs: np.ndarray | None = None  # float32, the KL reference's logprobs ([trainer.loss.kl] only)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def collate(samples: list[TrainingSample]) -> MicroBatch:
    lengths = np.array([len(s) for s in samples])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    total = int(lengths.sum())
    first_token = np.zeros(total, dtype=bool)
    first_token[starts] = True
    arrays = {name: np.concatenate([getattr(s, name) for s in samples]) for name in TOKEN_FIELDS}
    for loss in LOSS_NAMES:
        arrays[f"{loss}_mask"] = arrays[f"{loss}_mask"].astype(bool) & ~first_token
    with_ref = [s.ref_logprobs is not None for s in samples]
    ref = np.concatenate([s.ref_logprobs for s in samples]).astype(np.float32) if all(with_ref) else None
    if any(with_ref) and ref is None:
        raise PackingError("ref_logprobs: every sample of a batch carries the reference's logprobs, or none does")
    sample_temperature = np.repeat(np.array([s.temperature for s in samples], dtype=np.float32), lengths)
    return MicroBatch(
        input_ids=arrays.pop("input_ids").astype(np.int64),
        position_ids=np.arange(total, dtype=np.int64) - np.repeat(starts, lengths),
        segment_ids=np.repeat(np.arange(len(samples), dtype=np.int64), lengths),
        temperature=np.where(arrays.pop("sampled").astype(bool), sample_temperature, np.float32(1.0)),
        **{name: value.astype(np.float32) if not name.endswith("_mask") else value for name, value in arrays.items()},
        ref_logprobs=ref,
    )


def empty_micro_batch() -> MicroBatch:
    """One token with no mask: a rank without work runs it so that its collectives still match the others'."""
    zero_f, zero_i = np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.int64)
    no = np.zeros(1, dtype=bool)
    return MicroBatch(
        input_ids=zero_i, position_ids=zero_i, segment_ids=zero_i, temperature=np.ones(1, dtype=np.float32),
        inference_logprobs=zero_f, rl_values=zero_f, rl_mask=no, ce_values=zero_f, ce_mask=no,
    )


def pack(samples: list[TrainingSample], limit: int, truncate: bool = False) -> list[MicroBatch]:
    """Micro-batches of at most `limit` tokens, first-fit-decreasing."""
    samples = fit_to_limit(samples, limit, truncate)
    bins = first_fit_decreasing([len(s) for s in samples], limit)
    return [collate([samples[i] for i in sorted(b)]) for b in bins]


def assign_to_ranks(micro_batches: list[MicroBatch], world_size: int) -> list[list[MicroBatch]]:
    """Balance micro-batches across ranks by token count (largest first onto the least loaded rank).

    Every rank gets the same number of micro-batches, padded with empty ones, so
    that FSDP's per-forward collectives and the final gradient sync line up.
    """
    order = sorted(range(len(micro_batches)), key=lambda i: (-micro_batches[i].num_tokens, i))
    ranks: list[list[MicroBatch]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], len(ranks[k]), k))
        ranks[r].append(micro_batches[i])
        load[r] += micro_batches[i].num_tokens
    depth = max(1, max(len(r) for r in ranks))
    for r in ranks:
        r.extend(empty_micro_batch() for _ in range(depth - len(r)))
    return ranks
