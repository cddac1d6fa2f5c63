"""The output layer's logprobs in vocabulary chunks: half-precision GEMMs summed in float32, no full logits.

The trainer needs, per scored position, the logprob of one target token and the entropy. Per chunk
of the vocabulary, `chunked_logprobs` computes the chunk's logits of all positions

    z[:, c] = (hidden @ W[c]^T) / T        hidden, W in the compute dtype d, the sums in float32

and folds them into an online float32 logsumexp (running max m, sum s = sum e^(z - m), and
t = sum e^(z - m) z for the entropy), keeping the target's logit as its chunk passes:

    logprob = z[target] - lse,   entropy = lse - t / s,   lse = m + log s

so the [positions, vocabulary] float32 logits (and their log-softmax) never exist: one chunk's
are alive at a time. The backward recomputes each chunk's logits from the saved lse (softmax
p = e^(z - lse)) and runs its two GEMMs in d: dlogits = g (onehot - p) / T, dhidden += dlogits W[c]
(summed in float32 over chunks), dW[c] = dlogits^T hidden.

Where the sums are float32 (`float32_sums`): on CUDA `torch.mm(a, b, out_dtype=torch.float32)`,
the tensor cores' bfloat16 GEMM with its float32 accumulator written out unrounded. CPUs (torch
2.13) have no such GEMM: a bfloat16 GEMM there (oneDNN) accumulates in float32 but rounds its
output to bfloat16, up to ~0.5 on a logit of a 896-wide model, the sampler-trainer gap the float32
head was made to close. So on CPU each chunk is a float32 GEMM of the rounded inputs
(`float32_head.float32_copy` of the weight, made once per weight version): the products of
half-precision values are exact in float32, the same numbers as `float32_head`'s; the backward
GEMMs stay in d, as there. Logits are equal to the float32 head's up to float32 summation order,
and so are logprobs and entropies. Where the caller allows it (`bfloat16_gemms`), a bfloat16 pair's
float32 GEMMs run in oneDNN's bfloat16 math mode (`bfloat16_products`): the same exact products, at
the bfloat16 rate.
"""

from __future__ import annotations

import functools

import torch

from trace_rl.models.bfloat16_products import bfloat16_products
from trace_rl.models.float32_head import float32_copy

# float32 logits of one chunk (positions x vocabulary columns) by device type; a chunk's forward and backward hold a
# few tensors of that many. 64 MB on a CPU; 2 GB on CUDA, where small chunks leave the GPU waiting on launches.
LOGITS_PER_CHUNK = {"cpu": 2**24, "cuda": 2**29}
# vocabulary columns per chunk are a multiple of this (GEMM tiles), and at least this many
COLUMN_ALIGNMENT = 256


def vocabulary_chunk(positions: int, vocab_size: int, device_type: str) -> int:
    """Vocabulary columns per chunk for `positions` rows: the device's `LOGITS_PER_CHUNK` budget, aligned."""
    budget = LOGITS_PER_CHUNK.get(device_type, LOGITS_PER_CHUNK["cpu"])
    columns = budget // max(positions, 1) // COLUMN_ALIGNMENT * COLUMN_ALIGNMENT
    return min(vocab_size, max(COLUMN_ALIGNMENT, columns))


@functools.cache
def has_float32_out_mm(device_type: str) -> bool:
    """Whether `torch.mm(half, half, out_dtype=torch.float32)` runs on this device type (CUDA in recent torch; torch
    2.13 has no CPU kernel for it)."""
    if device_type != "cuda":
        return False
    try:
        a = torch.ones(16, 16, device=device_type, dtype=torch.bfloat16)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def float32_sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float32: the half-precision GEMM with a float32 output where the device has one, else a float32 GEMM
    of the inputs."""
    if a.dtype != torch.float32 and has_float32_out_mm(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def logit_operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the forward GEMMs read: hidden and weight as they are where `float32_sums` has a half-precision GEMM
    with float32 output, else both in float32, cast once (the weight once per version, `float32_copy`)."""
    if hidden.dtype == torch.float32 or has_float32_out_mm(hidden.device.type):
        return hidden, weight
    return hidden.float(), float32_copy(weight)


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden (P, H), weight (V, H)) in one dtype -> (logprob of each target, entropy), float32, per position."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, columns: int, softcap: float | None, bfloat16_gemms: bool):
        left, right = logit_operands(hidden, weight)
        bfloat16_gemms = bfloat16_gemms and hidden.dtype == torch.bfloat16 and left.dtype == torch.float32
        positions = hidden.shape[0]
        m = hidden.new_full((positions,), -torch.inf, dtype=torch.float32)
        s, t, target_z = (hidden.new_zeros(positions, dtype=torch.float32) for _ in range(3))
        buffers = ChunkBuffers(positions, columns, hidden.device)
        for start in range(0, weight.shape[0], columns):
            with bfloat16_products(bfloat16_gemms):
                z = chunk_logits(left, right, start, columns, temperature, softcap, buffers)
            new_m = torch.maximum(m, z.amax(dim=1))
            e = torch.sub(z, new_m[:, None], out=buffers.take("scratch", torch.float32, z.shape[1])).exp_()
            scale = torch.exp(m - new_m)
            s = s * scale + e.sum(dim=1)
            t = t * scale + e.mul_(z).sum(dim=1)
            m = new_m
            inside = (targets >= start) & (targets < start + z.shape[1])
            at = (targets - start).clamp(0, z.shape[1] - 1)
            target_z = torch.where(inside, z.gather(1, at[:, None]).squeeze(1), target_z)
        lse = m + torch.log(s)
        ctx.save_for_backward(hidden, weight, targets, temperature, lse)
        ctx.columns, ctx.softcap, ctx.bfloat16_gemms = columns, softcap, bfloat16_gemms
        # a CPU's backward writes into the forward's buffers (CUDA's caching allocator reuses memory by itself, and
        # keeping its 2 GB chunks alive through the decoder's backward would raise the peak)
        ctx.buffers = buffers if hidden.device.type == "cpu" else None
        entropy = lse - t / s
        ctx.mark_non_differentiable(entropy)
        return target_z - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, temperature, lse = ctx.saved_tensors
        columns, softcap = ctx.columns, ctx.softcap
        left, right = logit_operands(hidden, weight)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        g = grad_logprob.float()
        buffers, ctx.buffers = ctx.buffers or ChunkBuffers(hidden.shape[0], columns, hidden.device), None
        for start in range(0, weight.shape[0], columns):
            # in place where a tensor is not read again: a CUDA chunk is 2^29 float32 logits, 2 GB each
            with bfloat16_products(ctx.bfloat16_gemms):
                logits = chunk_logits(left, right, start, columns, None, None, buffers)
            capped = torch.tanh(logits / softcap) * softcap if softcap else logits
            z = capped / temperature[:, None] if softcap else capped.div_(temperature[:, None])
            dz = z.sub_(lse[:, None]).exp_().mul_(-g[:, None])  # -g p
            inside = (targets >= start) & (targets < start + dz.shape[1])
            at = (targets - start).clamp(0, dz.shape[1] - 1)
            dz.scatter_add_(1, at[:, None], torch.where(inside, g, 0.0)[:, None])
            dz.div_(temperature[:, None])
            if softcap:
                dz.mul_(1 - (capped / softcap) ** 2)
            dlogits = dz
            if dz.dtype != hidden.dtype:
                dlogits = buffers.take("scratch", hidden.dtype, dz.shape[1]).copy_(dz)
            chunk = weight[start:start + columns]
            if need_hidden:
                grad_hidden += float32_sums(dlogits, chunk) if has_float32_out_mm(chunk.device.type) \
                    else (dlogits @ chunk).float()
            if need_weight:
                torch.mm(dlogits.t(), hidden, out=grad_weight[start:start + columns])
        return (grad_hidden.to(hidden.dtype) if need_hidden else None, grad_weight, None, None, None, None, None)


class ChunkBuffers:
    """The memory a chunk writes into, made at its first use and reused by every chunk (a fresh 64 MB tensor per
    chunk and op costs its page faults each time on a CPU): per kind, room for (positions, columns) float32 values,
    `logits` (the float32 logits), `scratch` (the forward's exponentials, the backward's half-precision gradient)."""

    def __init__(self, positions: int, columns: int, device: torch.device):
        self.positions, self.columns, self.device = positions, columns, device
        self.flat: dict[str, torch.Tensor] = {}

    def take(self, kind: str, dtype: torch.dtype, columns: int) -> torch.Tensor:
        """The `kind` memory as a (positions, columns) tensor of `dtype` (at most 4 bytes), columns <= the chunk's."""
        if kind not in self.flat:
            self.flat[kind] = torch.empty(self.positions * self.columns * 4, dtype=torch.uint8, device=self.device)
        size = self.positions * columns * dtype.itemsize
        return self.flat[kind][:size].view(dtype).view(self.positions, columns)


def chunk_logits(left, right, start: int, columns: int, temperature, softcap, buffers: ChunkBuffers) -> torch.Tensor:
    """The float32 logits of vocabulary rows [start, start + columns) (`logit_operands`): float32 operands' in
    `buffers`' logits (CUDA's caching allocator reuses the memory of a half-precision pair's without it);
    soft-capped and tempered where those are given."""
    rows = right[start:start + columns]
    if left.dtype == torch.float32:
        logits = torch.mm(left, rows.t(), out=buffers.take("logits", torch.float32, rows.shape[0]))
    else:
        logits = float32_sums(left, rows.t())
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits if temperature is None else logits.div_(temperature[:, None])


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                     softcap: float | None = None, columns: int | None = None,
                     bfloat16_gemms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob (with grad) and entropy (without) of `targets` under the output layer `weight` (V, H) on `hidden`
    (P, H), both in the compute dtype: logits soft-capped at `softcap` (None: not), divided by `temperature` (P,),
    over vocabulary chunks of `columns` (None: `vocabulary_chunk`'s). `bfloat16_gemms`: a bfloat16 pair's logits
    GEMMs on a CPU in oneDNN's bfloat16 math mode (`bfloat16_products`), the same products at the bfloat16 rate;
    only where no other thread of the process runs a float32 matmul meanwhile."""
    if columns is None:
        columns = vocabulary_chunk(hidden.shape[0], weight.shape[0], hidden.device.type)
    with torch.autocast(hidden.device.type, enabled=False):
        return ChunkedLogprobs.apply(hidden, weight, targets, temperature.float(), columns, softcap, bfloat16_gemms)
