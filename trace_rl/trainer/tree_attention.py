"""One FlexAttention call per layer over a packed row: a query sees a key iff the key is on its path.

A packed row (`trace_rl.trainer.varlen.RowLayout`) is a prefix tree: each token's path is its
segment's context (the row ranges of the prefix it continues) followed by its segment's own
tokens. Attention over the whole row is then one call with the mask

    sees(q, k) = k in context(segment(q))  or  (segment(k) = segment(q) and k <= q)

which `torch.nn.attention.flex_attention` takes as a block mask: (128 x 128)-blocks that no query
of a block sees are skipped, the fully visible ones run without the mask. The mask is built once
per micro-batch from two tables, the segment of each row position and, per segment, which row
positions are its context, and serves every layer.

Outputs (and, on CUDA, q/k/v gradients) equal `packed_sdpa`'s, which runs one SDPA per layer
over the segments padded to the longest. On CUDA the
kernel is compiled (Triton); on CPU torch 2.13 has no FlexAttention backward, so training there
keeps `packed_sdpa`, and the forward runs eagerly (the unfused reference, for tests).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

from trace_rl.trainer.varlen import RowLayout, check_packed_row

TREE_ATTENTION = "packed_flex"


def path_tables(layout: RowLayout, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment of each of the `length` row positions, int64; (segments x length) bool, True where a row position
    is in the segment's context)."""
    segment = np.zeros(length, dtype=np.int64)
    context = np.zeros((len(layout.segments), length), dtype=bool)
    for index, (start, end, ranges) in enumerate(layout.segments):
        segment[start:end] = index
        for a, b in ranges:
            context[index, a:b] = True
    return segment, context


BLOCK = 128  # FlexAttention's sparse block, queries and keys
QUERY_ROWS_PER_PASS = 1024  # query rows whose (rows x length) visibility is made at once: 32 MB at 32k positions


def tree_block_mask(layout: RowLayout, length: int, device: torch.device) -> BlockMask:
    """The block mask of `sees` over a row of `length` positions, on `device`.

    Made from the visibility of each query row (QUERY_ROWS_PER_PASS at a time): per (BLOCK x BLOCK) block, whether
    a query sees any key of it (the block runs) and all keys (it runs without the mask), a few tensor ops per pass.
    `create_block_mask` evaluates `sees` through vmap instead: 25 s on a CPU for a row of 29.5k positions.
    """
    segment_np, context_np = path_tables(layout, length)
    segment, context = torch.from_numpy(segment_np).to(device), torch.from_numpy(context_np).to(device)

    def sees(batch, head, q, k):
        own = segment[q]
        return context[own, k] | ((segment[k] == own) & (k <= q))

    blocks = -(-length // BLOCK)
    padded = blocks * BLOCK
    # padding positions see nothing and are seen by nothing: a row's last block runs with the mask
    pad_segment = torch.cat([segment, segment.new_full((padded - length,), -1)])
    pad_context = torch.nn.functional.pad(context, (0, padded - length))
    keys = torch.arange(padded, device=device)
    partial_parts, full_parts = [], []
    for first in range(0, padded, QUERY_ROWS_PER_PASS):
        rows = keys[first:first + QUERY_ROWS_PER_PASS]
        own = pad_segment[rows]
        visible = ((pad_segment[None, :] == own[:, None]) & (keys[None, :] <= rows[:, None])) | \
            pad_context[own.clamp(min=0)]
        visible &= (own >= 0)[:, None]
        visible = visible.view(len(rows) // BLOCK, BLOCK, blocks, BLOCK)
        seen = visible.any(dim=3).any(dim=1)
        full = visible.all(dim=3).all(dim=1)
        partial_parts.append(seen & ~full)
        full_parts.append(full)

    def kv_blocks(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)  # the chosen blocks first, in order
        return chosen.sum(dim=1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*kv_blocks(torch.cat(partial_parts)), *kv_blocks(torch.cat(full_parts)),
                                    BLOCK_SIZE=BLOCK, mask_mod=sees, seq_lengths=(length, length))


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled (the fused Triton kernel on CUDA), once per process."""
    return torch.compile(flex_attention)


def packed_flex_attention(
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
    """query (1, heads, T, dim), key/value (1, kv heads, T, dim) -> (1, T, heads, dim), each query over its path in
    `row_layout` (None: the row is one causal sequence)."""
    check_packed_row(TREE_ATTENTION, query, attention_mask)
    if dropout:
        raise ValueError(f"{TREE_ATTENTION} has no attention dropout (the model's is {dropout}); use packed_sdpa")
    length = query.shape[2]
    if row_layout is None:
        row_layout = RowLayout([(0, length, ())])
    block_mask = row_layout.cached(("block_mask", length, query.device),
                                   lambda: tree_block_mask(row_layout, length, query.device))
    attend = compiled_flex_attention() if query.device.type == "cuda" else flex_attention
    out = attend(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


# run eagerly inside a compiled decoder block (`trainer.compile`): traced, the row's Python layout would be a guard
# and every micro-batch a recompilation
AttentionInterface.register(TREE_ATTENTION, torch.compiler.disable(packed_flex_attention))
