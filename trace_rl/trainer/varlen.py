"""Variable-length attention over a packed row: each sample attends only to its own earlier tokens.

A packed micro-batch concatenates samples; instead of one dense (T x T) block-diagonal mask, which
costs attention over every pair of the row's tokens, the row's sample boundaries travel with the model
call as `cu_seq_lens_q`/`cu_seq_lens_k` (cumulative lengths, the flash-attention varlen convention) and

    out[s] = softmax(q[s] k[s]^T * scale + causal) v[s]    for each sample s,

costs sum_s L_s^2 instead of T^2. `PACKED_ATTENTION` ("packed_sdpa") runs it as one causal
`scaled_dot_product_attention` per sample (flash/efficient kernels on CUDA, the fused CPU kernel on
CPU); transformers' `flash_attention_2` reads the same arguments for its varlen kernel.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from transformers import AttentionInterface

PACKED_ATTENTION = "packed_sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (1, heads, T, dim), key/value (1, kv heads, T, dim) -> (1, T, heads, dim), causal within each sample."""
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError(f"{PACKED_ATTENTION} takes one packed row (batch 1) and no attention mask; got batch "
                         f"{query.shape[0]}{' and a mask' if attention_mask is not None else ''}")
    bounds = [0, query.shape[2]] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    gqa = query.shape[1] != key.shape[1]
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa,
        )
        for start, end in pairwise(bounds)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)


def varlen_arguments(position_ids: torch.Tensor) -> dict:
    """The model-call arguments naming the samples of a packed row from its per-sample position ids (0 starts one)."""
    starts = torch.nonzero(position_ids == 0).flatten()
    cu_seq_lens = torch.cat([starts, starts.new_tensor([len(position_ids)])]).to(torch.int32)
    longest = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
            "max_length_k": longest}
