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

float32(round_d(W)) of the trainer's compute copy and of a sampler's model is made once per value of the
weight (`keep_float32_copy`): the output layer is read by every chunk of positions, again when a chunk is
recomputed in backward, and by every decoding step, and its cast (151,936 x 896 at Qwen2.5-0.5B's shape:
0.8 GB of memory traffic) costs about what a chunk's matmul does on hardware with bfloat16 matmuls.
"""

from __future__ import annotations

import weakref

import torch

# id(weight) -> [its version when cast (-1: not yet), its float32 copy] for the weights of `keep_float32_copy`
FLOAT32_COPIES: dict[int, list] = {}


def keep_float32_copy(weight: torch.Tensor) -> None:
    """Let `float32_copy` keep `weight`'s float32 copy until `weight` is written in place (`copy_`, an optimizer:
    what moves its version counter). Only for such a weight: FSDP2 refills its unsharded parameters without
    moving their versions."""
    if id(weight) not in FLOAT32_COPIES:
        FLOAT32_COPIES[id(weight)] = [-1, None]
        weakref.finalize(weight, FLOAT32_COPIES.pop, id(weight), None)


def float32_copy(weight: torch.Tensor) -> torch.Tensor:
    """`weight.float()`; for a weight of `keep_float32_copy`, cast again only when its version moved, into the
    copy it had (a fresh tensor of an output layer's size costs its page faults on a CPU: 25 against 9 ms for
    SmolLM2-135M's 49,152 x 576). So a copy is valid until the weight's next change, and no one keeps it past that."""
    kept = FLOAT32_COPIES.get(id(weight))
    if kept is None:
        return weight.float()
    if kept[0] != weight._version:
        copy = kept[1]
        if copy is None or copy.shape != weight.shape or copy.device != weight.device:
            copy = weight.detach().float()
        else:
            copy.copy_(weight.detach())
        kept[:] = [weight._version, copy]
    return kept[1]


class HalfInputFloatLogits(torch.autograd.Function):
    """(positions, hidden) x (vocabulary, hidden) in a half dtype -> float32 logits; gradients in the half dtype."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            return hidden.float() @ float32_copy(weight).t()

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
        keep_float32_copy(head.weight)
        head.register_forward_hook(lambda module, args, output: float32_logits(module, args[0], module.weight.dtype))
