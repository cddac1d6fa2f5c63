"""Prefix trees: the samples of a micro-batch stored with every shared token prefix once.

Samples that start with the same tokens (a GRPO group's prompt, a multi-turn trace's common history
in each of its branches, any common prefix from position 0) compute the same hidden states there:
attention is causal and the positions are the same. The row holds such a prefix once; each
continuation is a segment of the row that attends to the prefix's tokens (its context) and to its
own earlier tokens (`trace_rl.trainer.varlen`), with the position ids it has in its own sample.

In lexicographic order a sample's longest common prefix with any earlier sample is the one with the
sample just before it, so one pass over the sorted samples builds the tree: each sample adds its
tokens after that common prefix as a new segment, whose context is the previous sample's row
positions of the prefix. Every sample keeps its *path*: the row position of each of its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trace_rl.trainer.varlen import RowLayout


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def lexicographic_order(token_ids: list[np.ndarray]) -> list[int]:
    """Indices of the token sequences sorted lexicographically (a prefix before its continuations; ties by index)."""
    return sorted(range(len(token_ids)), key=lambda i: (token_ids[i].tolist(), i))


def runs(positions: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Row positions in order as (start, end) ranges of consecutive positions."""
    if len(positions) == 0:
        return ()
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(positions)]])
    return tuple((int(positions[s]), int(positions[e - 1]) + 1) for s, e in zip(starts, ends))


@dataclass
class PrefixTree:
    """A micro-batch's row of distinct positions and each sample's path through it."""

    row_ids: np.ndarray  # int64, the token at each row position
    row_positions: np.ndarray  # int64, each row position's position id in its samples (its depth in the tree)
    layout: RowLayout
    paths: list[np.ndarray]  # int64, per sample (in the order given): the row position of each of its tokens


def build_tree(token_ids: list[np.ndarray], share: bool) -> PrefixTree:
    """The row of `token_ids`; `share=False` puts every sample in the row whole, side by side, in the given order."""
    order = lexicographic_order(token_ids) if share else list(range(len(token_ids)))
    paths: list[np.ndarray | None] = [None] * len(token_ids)
    segments = []
    pieces: list[np.ndarray] = []
    size = 0
    previous = None
    for i in order:
        ids = np.asarray(token_ids[i], dtype=np.int64)
        shared = common_prefix(token_ids[previous], ids) if share and previous is not None else 0
        path = np.empty(len(ids), dtype=np.int64)
        if shared:
            path[:shared] = paths[previous][:shared]
        new = len(ids) - shared
        path[shared:] = np.arange(size, size + new)
        if new:
            context = runs(path[:shared])
            segments.append((size, size + new, context))
            pieces.append(ids[shared:])
            size += new
        paths[i] = path
        previous = i
    row_ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    row_positions = np.zeros(size, dtype=np.int64)
    for path in paths:
        row_positions[path] = np.arange(len(path))
    return PrefixTree(row_ids=row_ids, row_positions=row_positions, layout=RowLayout(segments), paths=paths)


def shared_units(token_ids: list[np.ndarray], limit: int) -> tuple[list[list[int]], list[int]]:
    """The samples in lexicographic order cut into units to pack whole, and each unit's distinct positions: a run
    of neighbours sharing a prefix, cut where the next sample shares nothing or would take the unit over `limit`
    distinct positions (the next unit then carries the prefix again). Every sample must fit `limit` alone."""
    units: list[list[int]] = []
    sizes: list[int] = []
    previous = None
    for i in lexicographic_order(token_ids):
        shared = common_prefix(token_ids[previous], token_ids[i]) if previous is not None else 0
        if units and shared and sizes[-1] + len(token_ids[i]) - shared <= limit:
            units[-1].append(i)
            sizes[-1] += len(token_ids[i]) - shared
        else:
            units.append([i])
            sizes.append(len(token_ids[i]))
        previous = i
    return units, sizes
