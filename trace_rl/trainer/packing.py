"""Packing training samples into micro-batches of at most `trainer.micro_batch_tokens` distinct positions.

A micro-batch is one row the model computes. With `share_prefixes` it is a prefix tree
(`trace_rl.trainer.prefix_tree`): a token prefix several of its samples start with is stored
once and each continuation attends to it; without, the samples sit side by side. Either way
each sample keeps its own position ids (0, 1, ...) and attends only to its own earlier tokens
(`trace_rl.trainer.varlen`), so attention runs over the segments instead of a dense (T x T) mask.

Besides the row, a micro-batch keeps every sample's own per-token arrays, concatenated (the
*view* the loss reads, the same with or without sharing), and the output-layer *queries*: one
per distinct (predicting row position, target token, temperature) whose logprob the view reads.
Each view token points at its query, so a shared token read by several samples is computed
once and counts once per sample. The first token of a sample has no prediction (its logprob
is 0 by convention), so any mask there is dropped.

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
from trace_rl.trainer.prefix_tree import build_tree, shared_units
from trace_rl.trainer.varlen import RowLayout

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
    """One packed row (`row_*`, `layout`), its output-layer queries (`query_*`) and its samples' per-token view."""

    row_ids: np.ndarray  # int64, the row's distinct positions' tokens
    row_positions: np.ndarray  # int64, each row position's position id in its samples
    layout: RowLayout
    query_source: np.ndarray  # int64, the row position whose logits predict the query's target
    query_target: np.ndarray  # int64
    query_temperature: np.ndarray  # float32, the query's logits divisor
    # the view: every sample's tokens in order, as the loss reads them
    input_ids: np.ndarray  # int64
    position_ids: np.ndarray  # int64, restarting at 0 for each sample
    segment_ids: np.ndarray  # int64, which sample of the micro-batch each token belongs to
    temperature: np.ndarray  # float32, logits divisor predicting each token: the sample temperature if sampled, else 1
    view_query: np.ndarray  # int64, the query giving each token's logprob; -1: not computed (logprob 0)
    inference_logprobs: np.ndarray
    rl_values: np.ndarray
    rl_mask: np.ndarray
    ce_values: np.ndarray
    ce_mask: np.ndarray
    ref_logprobs: np.ndarray | None = None  # float32, the KL reference's logprobs ([trainer.loss.kl] only)

    @property
    def num_tokens(self) -> int:
        """Distinct positions the model computes (what `micro_batch_tokens` bounds)."""
        return len(self.row_ids)

    @property
    def view_tokens(self) -> int:
        """The samples' tokens, each shared one counted once per sample."""
        return len(self.input_ids)


def output_queries(paths: list[np.ndarray], input_ids: np.ndarray, temperature: np.ndarray,
                   read: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (source row position, target, temperature) of the view tokens in `read`, and each view token's
    query (-1 outside `read`). A token's query is keyed by its own row position (which fixes source and target)
    and its temperature."""
    path = np.concatenate(paths)
    predecessor = np.concatenate([np.concatenate([[-1], p[:-1]]) for p in paths])
    read = read & (predecessor >= 0)
    keys = np.stack([path[read].astype(np.float64), temperature[read].astype(np.float64)], axis=1)
    distinct, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    view_query = np.full(len(path), -1, dtype=np.int64)
    view_query[read] = inverse.reshape(-1)
    where = np.flatnonzero(read)[first]
    return (predecessor[where].astype(np.int64), input_ids[where].astype(np.int64),
            distinct[:, 1].astype(np.float32), view_query)


def collate(samples: list[TrainingSample], share: bool = False, loss_positions_only: bool = False) -> MicroBatch:
    """One micro-batch of `samples` (in this order in the view). `share`: store shared prefixes once.
    `loss_positions_only`: compute logprobs only where a channel's mask is (the loss, the mismatch metrics and the
    KL read nothing else); else on every token but each sample's first."""
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
    input_ids = arrays.pop("input_ids").astype(np.int64)
    temperature = np.where(arrays.pop("sampled").astype(bool), sample_temperature, np.float32(1.0))
    tree = build_tree([s.input_ids for s in samples], share)
    read = (arrays["rl_mask"] | arrays["ce_mask"]) if loss_positions_only else ~first_token
    source, target, query_temperature, view_query = output_queries(tree.paths, input_ids, temperature, read)
    return MicroBatch(
        row_ids=tree.row_ids, row_positions=tree.row_positions, layout=tree.layout,
        query_source=source, query_target=target, query_temperature=query_temperature,
        input_ids=input_ids,
        position_ids=np.arange(total, dtype=np.int64) - np.repeat(starts, lengths),
        segment_ids=np.repeat(np.arange(len(samples), dtype=np.int64), lengths),
        temperature=temperature, view_query=view_query,
        **{name: value.astype(np.float32) if not name.endswith("_mask") else value for name, value in arrays.items()},
        ref_logprobs=ref,
    )


def empty_micro_batch() -> MicroBatch:
    """One token with no mask: a rank without work runs it so that its collectives still match the others'."""
    zero_f, zero_i = np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.int64)
    no = np.zeros(1, dtype=bool)
    none_i = np.zeros(0, dtype=np.int64)
    return MicroBatch(
        row_ids=zero_i, row_positions=zero_i, layout=RowLayout([(0, 1, ())]), query_source=none_i,
        query_target=none_i, query_temperature=np.zeros(0, dtype=np.float32),
        input_ids=zero_i, position_ids=zero_i, segment_ids=zero_i, temperature=np.ones(1, dtype=np.float32),
        view_query=np.full(1, -1, dtype=np.int64),
        inference_logprobs=zero_f, rl_values=zero_f, rl_mask=no, ce_values=zero_f, ce_mask=no,
    )


def pack(samples: list[TrainingSample], limit: int, truncate: bool = False,
         share_prefixes: bool = False) -> list[MicroBatch]:
    """Micro-batches of at most `limit` distinct positions, first-fit-decreasing, with logprobs where a loss reads.

    `share_prefixes`: samples sharing a prefix are packed as units of lexicographic neighbours
    (`shared_units`), each unit's prefix once; the units are then packed first-fit-decreasing by
    their distinct positions. Without, every sample is its own unit (the order within a bin is the
    samples' given order)."""
    samples = fit_to_limit(samples, limit, truncate)
    if share_prefixes:
        units, sizes = shared_units([s.input_ids for s in samples], limit)
    else:
        units, sizes = [[i] for i in range(len(samples))], [len(s) for s in samples]
    bins = first_fit_decreasing(sizes, limit)
    return [
        collate([samples[i] for i in sorted(i for u in b for i in units[u])], share_prefixes, loss_positions_only=True)
        for b in bins
    ]


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
