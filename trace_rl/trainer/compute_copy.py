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
it at the start of a step (the frozen ones, LoRA's base, once when it is made); `add_gradients` adds its
gradients, in float32, to the master's after each micro-batch's backward, so the sum over micro-batches,
the gradient clipping and the AdamW update stay float32. Within one backward, the contributions of a weight
read more than once (a tied embedding and output layer, the output layer's chunks) add up in the compute
dtype, as under FSDP2's.
"""

from __future__ import annotations

import copy

import torch

from trace_rl.models.float32_head import keep_float32_copy


class ComputeCopy:
    """A copy of `master` with its parameters in `dtype`, for a step's forward and backward."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype):
        # the memo hands deepcopy each parameter's half-precision copy: no float32 copy of the model is made
        memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                for p in master.parameters()}
        self.module = copy.deepcopy(master, memo)
        self.pairs = [(p, memo[id(p)]) for p in master.parameters() if p.requires_grad]
        head = self.module.get_output_embeddings()
        if isinstance(head, torch.nn.Linear):
            keep_float32_copy(head.weight)  # the float32 output layer's, cast again after each refresh

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the trainable master weights into the copy (once per step, before its first forward)."""
        for master, half in self.pairs:
            half.copy_(master)

    @torch.no_grad()
    def add_gradients(self) -> None:
        """Add the copy's gradients to the master's in float32 and clear them (after each micro-batch's backward)."""
        for master, half in self.pairs:
            if half.grad is None:
                continue
            if master.grad is None:
                master.grad = half.grad.to(master.dtype)
            else:
                master.grad.add_(half.grad)
            half.grad = None
