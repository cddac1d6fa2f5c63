"""The output layer in float32 from half-precision inputs, in the trainer and in every sampler.

A half-precision output layer rounds each logit to its dtype: bfloat16's 8 bits of mantissa put
a logit of ~10 on a grid of 0.0625, so the sampler's and the trainer's logprobs of the same token
disagree by up to a few hundredths from the rounding alone. vLLM runs the head in float32 for RL
(`hf_overrides={"head_dtype": "float32"}`: its lm_head projects the bfloat16 hidden states into
float32 logits, the products accumulated in float32); trace-rl does the same everywhere:

    logits = float32(round_d(hidden)) @ float32(round_d(W))^T        d = model.dtype

Products of half-precision values are exact in float32, so this is the half-precision inputs'
exact logits up to float32 summation: no logit rounding on either side. The backward pass stays in
`d` (what the half-precision head's backward was), so only the forward costs float32 FLOPs.
"""

from __future__ import annotations

import torch


class HalfInputFloatLogits(torch.autograd.Function):
    """(positions, hidden) x (vocabulary, hidden) in a half dtype -> float32 logits; gradients in the half dtype."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            return hidden.float() @ weight.float().t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, weight = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):
            grad = grad.to(hidden.dtype)
            return grad @ weight, grad.t() @ hidden


def float32_logits(head: torch.nn.Module, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output layer `head` (a bias-free Linear) on `hidden` in float32, its inputs rounded to `dtype` (float32:
    the plain float32 layer). Another head (an adapted one) runs as it is, in float32."""
    if dtype == torch.float32 or type(head) is not torch.nn.Linear or head.bias is not None:
        with torch.autocast(hidden.device.type, enabled=False):
            return head(hidden.float())
    return HalfInputFloatLogits.apply(hidden.to(dtype), head.weight.to(dtype))


def compute_dtype(device: torch.device, parameter_dtype: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in here: autocast's when it is on, else the parameters'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return parameter_dtype


def use_float32_head(model: torch.nn.Module) -> None:
    """Make a half-precision transformers model's output layer give float32 logits (a forward hook replacing the
    output embeddings' result), for a sampler. An adapted head keeps its own."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.bias is None and head.weight.dtype != torch.float32:
        head.register_forward_hook(lambda module, args, output: float32_logits(module, args[0], module.weight.dtype))
