"""The half-precision compute copy: a `model.dtype` step runs forward and backward on a copy of the float32 master
weights in that dtype, cast once per step.

Autocast on the float32 master weights (what the trainer did before) casts every Linear's weight again in each
micro-batch, and leaves in float32 what takes float32 parameters: the embedding, so the residual stream and
every add along it, each RMSNorm's product with its float32 scale, the rotary products, the output layer's
input. Per micro-batch that is a cast of the weights and float32 element-wise work on every activation, on
hardware whose matmuls run 7x faster in bfloat16 (issue 44: 1.1-1.3x over float32 where the matmuls gain 7x).

The copy holds every parameter in the compute dtype (buffers, the rotary frequencies, stay float32), so the
model computes as the sampler's half-precision model does: the same dtype at every op, which is also what
FSDP2's `MixedPrecisionPolicy(param_dtype)` runs per block. `refresh` casts the trainable master weights into
it where they changed (the frozen ones, LoRA's base, once when it is made): at the export of the sampler's weights,
which then reads the copy instead of casting the master into fresh tensors, or else at the start of the next step.
A weight changed when its version counter moved: an in-place write (a checkpoint's restore) moves it, and the
trainer moves those of the weights its fused AdamW wrote, which does not (torch 2.13). `add_gradients` adds its
gradients, in float32, to the master's after each micro-batch's backward, so the sum over micro-batches,
the gradient clipping and the AdamW update stay float32. Within one backward, the contributions of a weight
read more than once (the output layer's chunks) add up in the compute dtype, as under FSDP2's.

The copy's trainable input embedding takes a sparse gradient (`nn.Embedding(sparse=True)`): the rows of the
micro-batch's tokens, not a dense (vocabulary, hidden) tensor that is almost all zeros. Where the embedding is
tied to the output layer, the copy reads one weight through two parameters (one storage, refreshed once): the
output layer's dense gradient and the embedding's rows reach the master apart and add up in float32
(`index_add_`). On SmolLM2-135M's 49,152 x 576 tied embedding that spares each backward a zeroed 57 MB
gradient and a 57 MB sum.
"""

from __future__ import annotations

import copy

import torch

from trace_rl.models.float32_head import keep_float32_copy
from trace_rl.models.rms_norm import use_one_rounding_norms


class ComputeCopy:
    """A copy of `master` with its parameters in `dtype`, for a step's forward and backward."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype):
        # the memo hands deepcopy each parameter's half-precision copy: no float32 copy of the model is made
        memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                for p in master.parameters()}
        self.module = copy.deepcopy(master, memo)
        self.pairs = [(p, memo[id(p)]) for p in master.parameters() if p.requires_grad]
        use_one_rounding_norms(self.module, dtype)  # as the sampler's norms compute
        head = self.module.get_output_embeddings()
        if isinstance(head, torch.nn.Linear):
            keep_float32_copy(head.weight)  # the float32 output layer's, cast again after each refresh
        self.refreshed = list(self.pairs)  # the (master, copy) pairs `refresh` casts: each storage once
        self.versions = [master._version for master, _ in self.refreshed]  # each master's at its last cast
        # (master, copy) of a trainable nn.Embedding input, whose sparse gradient `add_gradients` adds after the
        # others (a tied output layer's dense one first)
        self.embedding: tuple[torch.nn.Parameter, torch.nn.Parameter] | None = None
        embedding = self.module.get_input_embeddings()
        if isinstance(embedding, torch.nn.Embedding) and embedding.weight.requires_grad:
            if head is not None and head.weight is embedding.weight:
                embedding.weight = torch.nn.Parameter(embedding.weight.detach())  # one storage, gradients apart
            else:
                self.pairs = [(m, half) for m, half in self.pairs if half is not embedding.weight]
            embedding.sparse = True
            self.embedding = (master.get_input_embeddings().weight, embedding.weight)

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast into the copy each trainable master weight whose version moved since its last cast."""
        for i, (master, half) in enumerate(self.refreshed):
            if master._version != self.versions[i]:
                half.copy_(master)
                self.versions[i] = master._version

    @torch.no_grad()
    def add_gradients(self) -> None:
        """Add the copy's gradients to the master's in float32 and clear them (after each micro-batch's backward)."""
        for master, half in self.pairs:
            grad, half.grad = half.grad, None
            if grad is None:
                continue
            if master.grad is None:
                master.grad = grad.to(master.dtype)
            else:
                master.grad.add_(grad)
        if self.embedding is not None and self.embedding[1].grad is not None:
            master, half = self.embedding
            rows, half.grad = half.grad, None  # sparse: a token read twice is listed twice
            if master.grad is None:
                master.grad = torch.zeros_like(master)
            master.grad.index_add_(0, rows._indices()[0], rows._values().to(master.dtype))
