"""A half-precision packed row's attention on a CPU: float32 softmax attention as a few batched GEMMs.

For the padded batch of a row (`varlen.PaddedRow`: S slots of segments, each Lq queries over Lk keys) of a model
with H query heads over KV key/value heads (G = H / KV query heads read one), `GemmAttention` computes

    s = q k^T * scale (keys a query does not see: -inf),   p = softmax(s),   out = p v

with q, k and v cast once from the row's half-precision values to float32 and everything after in float32. A KV
head's G query heads are folded into its batch: S * KV batches of G * Lq queries over Lk keys, so no key or value
is repeated per query head. Its backward, from the saved p:

    dv = p^T dout,   dp = dout v^T,   ds = p * (dp - rowsum(dp * p)) * scale,   dq = ds k,   dk = ds^T q

The gathers into the padded batch and out of it are inside the function: a key gathered into several slots (a
shared context's) sums its slots' gradients in float32 (one `index_add_` each for q, k and v), rounded to the half
dtype once.

Why not torch's CPU flash attention: at the demo's sizes (about 40 slots of 32 queries over 73 keys, 9 heads over
3) its float32 kernel, with the casts and gathers around it, spends about 7 ms a layer, forward and backward, on
0.6 GFLOP, and its bfloat16 backward is several times slower (42.7 against 6.3 ms on the AMX Xeon). This function
is no slower and rounds once: two bfloat16 trainers stepped in turn, the flash path's against this one's, -17 and
-29 ms a step over SmolLM2-135M's 30 layers (8 and 14 rounds; bench/RESULTS-bf16.md, run 11), near the machine's
noise. Its GEMMs are most of its time (0.4-0.7 ms each, 160-270 GFLOP/s at these shapes); an earlier version with
the gathers and casts outside it gained nothing (run 7).
"""

from __future__ import annotations

import torch


class GemmAttention(torch.autograd.Function):
    """(q (H, T, D), k, v (KV, T, D), the row's `PaddedRow`, `hidden`, scale) -> out (T, H, D), in q's dtype.
    `hidden` (slots * KV, G * Lq, Lk) or broadcastable to it: True where a query slot does not see a key slot."""

    @staticmethod
    def forward(ctx, q, k, v, row, hidden, scale: float):
        heads, length, dim = q.shape
        kv = k.shape[0]
        group = heads // kv
        slots = row.queries.shape[0] // row.longest
        with torch.autocast(q.device.type, enabled=False):
            qf = gathered(q, row.queries, kv, group, slots, row.longest)
            kf = gathered(k, row.keys, kv, 1, slots, row.longest_keys)
            vf = gathered(v, row.keys, kv, 1, slots, row.longest_keys)
            p = torch.bmm(qf, kf.transpose(1, 2)).mul_(scale).masked_fill_(hidden, -torch.inf).softmax(-1)
            out = torch.bmm(p, vf)
        ctx.save_for_backward(qf, kf, vf, p, row.queries, row.keys, row.outputs)
        ctx.sizes = (heads, length, dim, kv, group, slots, row.longest, row.longest_keys)
        ctx.scale = scale
        # (slots * KV, G * Lq, D) -> (slots * Lq, H * D) in q's dtype -> the row's positions
        slotted = out.view(slots, kv, group, row.longest, dim).permute(0, 3, 1, 2, 4)
        slotted = torch.empty(slotted.shape, dtype=q.dtype, device=q.device).copy_(slotted)
        return slotted.view(slots * row.longest, heads * dim).index_select(0, row.outputs).view(length, heads, dim)

    @staticmethod
    def backward(ctx, grad_out):
        qf, kf, vf, p, queries, keys, outputs = ctx.saved_tensors
        heads, length, dim, kv, group, slots, longest, longest_keys = ctx.sizes
        with torch.autocast(grad_out.device.type, enabled=False):
            slotted = grad_out.new_zeros(slots * longest, heads * dim, dtype=torch.float32)
            slotted.index_copy_(0, outputs, grad_out.reshape(length, heads * dim).float())
            dout = torch.empty(slots, kv, group, longest, dim, dtype=torch.float32, device=grad_out.device)
            dout = dout.copy_(slotted.view(slots, longest, kv, group, dim).permute(0, 2, 3, 1, 4)).view_as(qf)
            dv = torch.bmm(p.transpose(1, 2), dout)
            ds = torch._softmax_backward_data(torch.bmm(dout, vf.transpose(1, 2)), p, -1, torch.float32)
            ds.mul_(ctx.scale)
            dq, dk = torch.bmm(ds, kf), torch.bmm(ds.transpose(1, 2), qf)
            return (scattered(dq, queries, length, kv, group, grad_out.dtype),
                    scattered(dk, keys, length, kv, 1, grad_out.dtype),
                    scattered(dv, keys, length, kv, 1, grad_out.dtype), None, None, None)


def gathered(x: torch.Tensor, index: torch.Tensor, kv: int, group: int, slots: int, length: int) -> torch.Tensor:
    """x (kv * group, T, D), positions `index` (slots * length) -> float32 (slots * kv, group * length, D): a
    KV head's `group` query heads one batch."""
    dim = x.shape[2]
    rows = x.index_select(1, index).view(kv, group, slots, length, dim).permute(2, 0, 1, 3, 4)
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device).copy_(rows)
    return out.view(slots * kv, group * length, dim)


def scattered(grad: torch.Tensor, index: torch.Tensor, length: int, kv: int, group: int,
              dtype: torch.dtype) -> torch.Tensor:
    """`gathered`'s backward: grad (slots * kv, group * L, D) float32 -> (kv * group, T, D) in `dtype`, each
    position's slots summed in float32."""
    dim = grad.shape[2]
    slots = grad.shape[0] // kv
    rows = grad.view(slots, kv, group, -1, dim).permute(0, 3, 1, 2, 4).reshape(-1, kv * group * dim)
    summed = rows.new_zeros(length, kv * group * dim).index_add_(0, index, rows)
    return summed.to(dtype).view(length, kv * group, dim).transpose(0, 1)


def hidden_slots(row, kv: int, group: int) -> torch.Tensor:
    """The keys each query slot of `row` (a `PaddedRow`) does not see, as `GemmAttention` takes them: its mask's
    complement folded to (slots * kv, group * Lq, Lk), or, for a row that shares nothing (no mask: each slot's
    causal), the causal complement (1, group * Lq, Lk)."""
    if row.mask is None:
        causal = torch.ones(row.longest, row.longest_keys, dtype=torch.bool, device=row.queries.device).tril()
        return ~causal.repeat(group, 1)[None]
    slots = row.mask.shape[0]
    folded = row.mask.expand(slots, kv * group, row.longest, row.longest_keys)
    return ~folded.reshape(slots * kv, group * row.longest, row.longest_keys)
