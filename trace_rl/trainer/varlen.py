"""Attention over a packed row of segments: each token sees its segment's context and its own segment's earlier tokens.

A packed micro-batch is one row of segments (`RowLayout`). A segment is a run of tokens that
continues a prefix stored earlier in the same row (its *context*: the token ranges of its shared
ancestors, in order), or starts from nothing. Instead of one dense (T x T) mask over the row,
each segment s with queries q[s] and context c(s) attends as

    out[s] = softmax(q[s] [k[c(s)]; k[s]]^T * scale + mask_s) [v[c(s)]; v[s]]

where `mask_s` lets every query see the whole context and is causal on the segment's own keys. A
segment without context is plain causal attention; a row of samples that share nothing is then one
causal attention per sample, sum_s L_s^2 over the samples instead of T^2 over the row.

`PACKED_ATTENTION` ("packed_sdpa") runs the whole row as one attention call per layer
(`PaddedRow`): the segments' queries, and their keys and values (context, then own), are gathered
by one index each into a batch of segments padded to the longest, one
`scaled_dot_product_attention` runs over the batch (causal where the row shares nothing, else
with the segments' masks), and one index gathers the outputs back into the row. In a row that shares, a few long
segments (a group's prompt) would pad every other one: `query_pieces` cuts them first. The gathers'
backward is one float32 `index_add_` each (`GatherRows`). On CUDA, in a half dtype, a row that shares nothing runs
`torch.nn.attention.varlen.varlen_attn` instead, with no padding. One call per segment, as this
module ran before, made 1,536 SDPA calls and 3,567 `cat`s a step on the GPU check's workload
(bench/RESULTS-bf16.md), its host time 1.8x its GPU time; the padded batch does at most
(segments x longest) / (sum of lengths) more attention FLOPs, for rows of similar lengths (a
GRPO group's samples) a few tenths.

On CPU a half-precision row attends in float32 as a few batched GEMMs (`gemm_attention.GemmAttention`, the
gathers inside): torch 2.13's CPU flash attention in float32 was no faster on the demo's rows, and its bfloat16
backward is several times slower. Attention's FLOPs are a few percent of the step's, and float32 attention
is the more exact. A row with attention dropout (a model whose `attention_dropout` is above 0) runs the padded SDPA
in its own dtype instead.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from transformers import AttentionInterface

from trace_rl.trainer.gemm_attention import GemmAttention, hidden_slots

PACKED_ATTENTION = "packed_sdpa"
HALF_DTYPES = (torch.bfloat16, torch.float16)


class RowLayout:
    """The segments of a packed row: `(start, end, context)` each, `context` the (start, end) ranges of the row
    the segment's tokens attend to before their own, all earlier in the row."""

    def __init__(self, segments: list[tuple[int, int, tuple[tuple[int, int], ...]]]):
        self.segments = segments
        self._cache: dict[tuple, object] = {}

    def cached(self, key: tuple, build):
        """`build()`'s value, made once per layout and `key` (a mask serves every layer of a micro-batch)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def shares(self) -> bool:
        """Whether any segment continues a stored prefix (the row is then no longer samples side by side)."""
        return any(context for _, _, context in self.segments)


# the query rows torch's CPU flash attention takes at a time, below 192 queries
QUERY_BLOCK = 32


def query_pieces(segments: list[tuple[int, int, tuple[tuple[int, int], ...]]]):
    """The segments of a row that shares, each one's own tokens cut into runs of at most `piece` queries, a later run
    taking its segment's earlier runs as context: the same attention, padded to fewer query slots. `piece` (a multiple
    of `QUERY_BLOCK`; the longest segment: no cut) minimizes pieces x (their padded queries + the longest keys), the
    slots the padded batch gathers and attends: for the demo's row of 31 segments, 4 to 50 queries over up to 70
    keys, cuts at 32 (33 pieces): its CPU flash attention, forward and backward, 10.1 to 7.4 ms a layer."""
    own = [end - start for start, end, _ in segments]
    longest_keys = max(sum(b - a for a, b in context) + end - start for start, end, context in segments)

    def slots(piece: int) -> int:
        padded = -(-min(piece, max(own)) // QUERY_BLOCK) * QUERY_BLOCK
        return sum(-(-length // piece) for length in own) * (padded + longest_keys)

    candidates = range(-(-max(own) // QUERY_BLOCK) * QUERY_BLOCK, 0, -QUERY_BLOCK)  # longest first: ties keep fewer
    piece = min(candidates, key=slots)
    return [(first, min(end, first + piece), context + (((start, first),) if first > start else ()))
            for start, end, context in segments for first in range(start, end, piece)]


class PaddedRow:
    """A row's segments as a batch padded to the longest segment (queries) and the longest context + segment (keys);
    in a row that shares, the segments are their `query_pieces`.

    `queries` (segments x longest) and `keys` (segments x longest keys) index the row position each padded slot
    reads (position 0 in padding); `outputs` (row length) the padded query slot each row position's output is
    in; `mask` (segments, 1, longest, longest keys), None where no segment has a context: each real query sees its
    context and its own earlier keys, a padding query sees the first key (a row that sees nothing would be NaN,
    and NaN times its zero gradient is NaN)."""

    @staticmethod
    def of(layout: RowLayout, length: int, device: torch.device) -> PaddedRow:
        """The layout's PaddedRow on `device`, made once per layout (every layer of a micro-batch reads it)."""
        return layout.cached(("padded", length, device), lambda: PaddedRow(layout, length, device))

    def __init__(self, layout: RowLayout, length: int, device: torch.device):
        segments = query_pieces(layout.segments) if layout.shares else layout.segments
        own = [end - start for start, end, _ in segments]
        seen = [sum(b - a for a, b in context) for _, _, context in segments]
        self.longest, self.longest_keys = max(own), max(c + o for c, o in zip(seen, own))
        queries = np.zeros((len(own), self.longest), dtype=np.int64)
        keys = np.zeros((len(own), self.longest_keys), dtype=np.int64)
        outputs = np.full(length, -1, dtype=np.int64)
        for index, (start, end, context) in enumerate(segments):
            queries[index, :end - start] = np.arange(start, end)
            keys[index, :seen[index] + end - start] = np.concatenate(
                [np.arange(a, b) for a, b in (*context, (start, end))])
            outputs[start:end] = index * self.longest + np.arange(end - start)
        if (outputs < 0).any():
            raise ValueError(f"the row layout leaves positions {np.flatnonzero(outputs < 0)[:5].tolist()} of "
                             f"{length} outside every segment")
        self.queries, self.keys, self.outputs = (torch.from_numpy(x.reshape(-1)).to(device)
                                                 for x in (queries, keys, outputs))
        self.mask = None
        if layout.shares:
            mask = np.zeros((len(own), 1, self.longest, self.longest_keys), dtype=bool)
            mask[:, :, :, 0] = True  # every real query sees it too: its context's or its own first key
            for index, (o, c) in enumerate(zip(own, seen)):
                mask[index, 0, :o, :c] = True
                mask[index, 0, :o, c:c + o] = np.tri(o, dtype=bool)
            self.mask = torch.from_numpy(mask).to(device)


class VarlenRow:
    """A row that shares nothing as `varlen_attn` takes it: the segments' cumulative starts and the longest."""

    def __init__(self, layout: RowLayout, device: torch.device):
        starts = [start for start, _, _ in layout.segments] + [layout.segments[-1][1]]
        self.cumulative = torch.tensor(starts, dtype=torch.int32, device=device)
        self.longest = max(end - start for start, end, _ in layout.segments)


@functools.cache
def has_varlen(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.nn.attention.varlen.varlen_attn` (FlashAttention's kernel: CUDA, half dtypes) runs here."""
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn

        x = torch.ones(4, 1, 64, device=device_type, dtype=dtype)
        cumulative = torch.tensor([0, 4], dtype=torch.int32, device=device_type)
        return varlen_attn(x, x, x, cumulative, cumulative, 4, 4, window_size=(-1, 0)).shape == x.shape
    except (ImportError, RuntimeError, NotImplementedError, TypeError):
        return False


class GatherRows(torch.autograd.Function):
    """x (N, ...) -> x[index] (len(index), ...); the backward one float32 `index_add_` into zeros of x's rows
    flattened: a row gathered twice (a shared context's keys) sums its gradients in float32, in one pass over whole
    rows (`index_select`'s own backward on a strided (T, heads, dim) view was the layer's slowest op on CPU)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.reshape(x.shape[0], -1).index_select(0, index).view(len(index), *x.shape[1:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        flat = grad.reshape(len(index), -1).float()
        summed = flat.new_zeros(ctx.rows, flat.shape[1]).index_add_(0, index, flat)
        return summed.to(grad.dtype).view(ctx.rows, *grad.shape[1:]), None


def check_packed_row(implementation: str, query: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """A packed attention takes one row of packed sequences (batch 1), laid out by its RowLayout, and no mask."""
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError(f"{implementation} takes one packed row (batch 1) and no attention mask; got batch "
                         f"{query.shape[0]}{' and a mask' if attention_mask is not None else ''}")


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    row_layout: RowLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (1, heads, T, dim), key/value (1, kv heads, T, dim) -> (1, T, heads, dim), each segment of `row_layout`
    (None: the row is one causal sequence) over its context and its own earlier tokens, in one attention call."""
    check_packed_row(PACKED_ATTENTION, query, attention_mask)
    length = query.shape[2]
    if row_layout is None:
        row_layout = RowLayout([(0, length, ())])
    gqa = query.shape[1] != key.shape[1]
    if query.device.type == "cpu" and query.dtype in HALF_DTYPES and not dropout:
        row = PaddedRow.of(row_layout, length, query.device)
        kv, group = key.shape[1], query.shape[1] // key.shape[1]
        hidden = row_layout.cached(("hidden", length, kv, group), lambda: hidden_slots(row, kv, group))
        scale = query.shape[3] ** -0.5 if scaling is None else scaling
        out = GemmAttention.apply(query.squeeze(0), key.squeeze(0), value.squeeze(0), row, hidden, scale)
        return out.unsqueeze(0), None
    # (T, heads, dim): the row's positions first, for the gathers; squeezed, not indexed ([0]'s backward writes its
    # gradient into a zeroed copy of the batch)
    q, k, v = (tensor.squeeze(0).transpose(0, 1) for tensor in (query, key, value))
    if not row_layout.shares and not dropout and has_varlen(query.device.type, query.dtype):
        from torch.nn.attention.varlen import varlen_attn

        row = row_layout.cached(("varlen", query.device), lambda: VarlenRow(row_layout, query.device))
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), row.cumulative, row.cumulative,
                          row.longest, row.longest, scale=scaling, window_size=(-1, 0), enable_gqa=gqa)
        return out.unsqueeze(0), None
    row = PaddedRow.of(row_layout, length, query.device)
    segments = row.queries.shape[0] // row.longest

    def batch(tensor: torch.Tensor, index: torch.Tensor, longest: int) -> torch.Tensor:
        return GatherRows.apply(tensor, index).view(segments, longest, *tensor.shape[1:]).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        batch(q, row.queries, row.longest), batch(k, row.keys, row.longest_keys),
        batch(v, row.keys, row.longest_keys), attn_mask=row.mask, dropout_p=dropout, scale=scaling,
        is_causal=row.mask is None, enable_gqa=gqa,
    )
    out = GatherRows.apply(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]), row.outputs)
    return out.unsqueeze(0), None


# run eagerly inside a compiled decoder block (`trainer.compile`): traced, the row's Python layout would be a guard
# and every micro-batch a recompilation
AttentionInterface.register(PACKED_ATTENTION, torch.compiler.disable(packed_sdpa_attention))
