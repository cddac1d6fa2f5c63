"""RMSNorm with one rounding, as vLLM computes it, for a half-precision model's forward and backward.

    y = round(x * rsqrt(mean(x²) + eps) * w)          (mean over the last dimension; all in float32)

transformers' RMSNorm (Llama's, and every model's that copies it) rounds twice: the normalized x to the model's
dtype, then its product with the weight. vLLM's kernels (CUDA's, and on CPU `trace_rl.inference.vllm_worker`'s)
and torch's `aten._fused_rms_norm` round once, to the same outputs but for about one in 10^5 (their float32
sums of squares in another order). In bfloat16 transformers' differs from them in a quarter of SmolLM2-135M's norm
outputs, by a rounding; one rounding is also nearer the exact norm (mean error 1.12e-3 against
1.49e-3 on a 728 x 576 input). `use_one_rounding_norms` has a half-precision model's norms compute it, so a
sampler and a trainer on transformers compute their norms as vLLM does.

`OneRoundingRMSNorm` is the norm as one forward op (torch's fused kernel, which saves the rows' rsqrt) and a
backward of a few float32 ops, against the dozen of autograd's over transformers' ops: forward and backward
1.49 against 2.31 ms on a 728 x 576 bfloat16 input on a 2-core AMX Xeon, 61 norms a step in SmolLM2-135M. With
x̂ = x * rstd and g the output's gradient (rstd = 1 / sqrt(mean(x²) + eps), H the last dimension's size):

    dw = Σ_rows g * x̂
    dx = rstd * (g * w - x̂ * mean(g * w * x̂))
"""

from __future__ import annotations

import torch


class OneRoundingRMSNorm(torch.autograd.Function):
    """`rms_norm(x, w, eps)` with one rounding of the output; the gradients computed in float32, rounded once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float().mul_(rstd)
        g = grad_y.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (g * x_hat).sum(dim=tuple(range(x.dim() - 1))).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        g.mul_(weight)  # float32 products of the bfloat16 weight, without a cast of it
        mean = (g * x_hat).mean(dim=-1, keepdim=True)
        grad_x = g.sub_(x_hat.mul_(mean)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


def one_rounding_forward(norm: torch.nn.Module, eps: float):
    """`norm`'s forward as `OneRoundingRMSNorm` where the input has the weight's half-precision dtype, else its own."""
    own = norm.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != norm.weight.dtype or hidden_states.dtype == torch.float32:
            return own(hidden_states)
        return OneRoundingRMSNorm.apply(hidden_states, norm.weight, eps)

    return forward


def is_plain_rms_norm(module: torch.nn.Module) -> float | None:
    """The epsilon of a norm that computes x * rsqrt(mean(x²) + eps) * w over its last dimension, as a float32
    probe shows (not Gemma's (1 + w), a norm with a bias or an offset); None for any other module."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or weight.dim() != 1
            or not isinstance(eps, float) or getattr(module, "bias", None) is not None):
        return None
    probe = torch.linspace(-2, 3, 2 * weight.shape[0], device=weight.device).view(2, -1)
    with torch.no_grad():
        try:
            out = module(probe)
        except (TypeError, RuntimeError):  # a norm with another signature, or that needs more than one input
            return None
        expected = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        if not isinstance(out, torch.Tensor) or out.shape != expected.shape \
                or not torch.allclose(out.float(), expected, rtol=1e-5, atol=1e-6):
            return None
    return eps


def use_one_rounding_norms(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """For a model that computes in `dtype` (its weights', or FSDP2's half-precision gathered ones): where that is
    half precision, have each plain RMSNorm compute `OneRoundingRMSNorm` (its forward replaced on the instance,
    taking over where the input has the weight's dtype); returns how many. A float32 model is left as it is."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    count = 0
    for module in model.modules():
        if "forward" in module.__dict__:  # replaced already
            continue
        eps = is_plain_rms_norm(module)
        if eps is not None:
            module.forward = one_rounding_forward(module, eps)
            count += 1
    return count
