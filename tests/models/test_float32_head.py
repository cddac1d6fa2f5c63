"""The output layer gives float32 logits from half-precision inputs, in the trainer and in the samplers."""

from __future__ import annotations

import pytest
import torch

from trace_rl.inference.vllm_engine import engine_arguments
from trace_rl.models.float32_head import float32_copy, float32_logits, keep_float32_copy, use_float32_head
from trace_rl.models.runtime import RuntimeConfig


def head_and_hidden(seed: int = 0, vocab: int = 300, width: int = 64):
    torch.manual_seed(seed)
    head = torch.nn.Linear(width, vocab, bias=False)
    head.weight.data *= 8  # logits of ~10, where bfloat16's grid is 0.0625 apart
    return head, torch.randn(5, width)


def test_the_logits_are_the_exact_products_of_the_rounded_inputs():
    head, hidden = head_and_hidden()
    logits = float32_logits(head, hidden, torch.bfloat16)
    exact = hidden.bfloat16().double() @ head.weight.bfloat16().double().t()
    assert logits.dtype == torch.float32 and logits.abs().max() > 8
    assert (logits.double() - exact).abs().max() < 1e-5
    rounded = (hidden.bfloat16() @ head.weight.bfloat16().t()).double()  # a bfloat16 head
    assert (rounded - exact).abs().max() > 1e-2
    # float32: the layer itself, bitwise
    assert torch.equal(float32_logits(head, hidden, torch.float32), head(hidden))


def test_gradients_flow_to_the_float32_weights_and_hidden_states_in_the_half_dtype():
    head, hidden = head_and_hidden(1)
    hidden.requires_grad_()
    weights = torch.randn(5, 300)
    (float32_logits(head, hidden, torch.bfloat16) * weights).sum().backward()
    assert head.weight.grad.dtype == hidden.grad.dtype == torch.float32
    w, h = head.weight.detach().bfloat16().double(), hidden.detach().bfloat16().double()
    expected_hidden, expected_weight = weights.double() @ w, weights.double().t() @ h
    for grad, expected in ((hidden.grad, expected_hidden), (head.weight.grad, expected_weight)):
        relative = (grad.double() - expected).abs().max() / expected.abs().max()
        assert relative < 2e-2  # the backward runs in bfloat16


def test_a_half_precision_sampler_model_gets_float32_logits(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[5, 17, 99, 3, 250, 12]])
    with torch.no_grad():
        before = model(ids).logits
        use_float32_head(model)
        after = model(ids).logits
        hidden = model.model(ids).last_hidden_state
    assert before.dtype == torch.bfloat16 and after.dtype == torch.float32
    assert torch.equal(after, float32_logits(model.lm_head, hidden, torch.bfloat16))
    torch.testing.assert_close(after, before.float(), atol=0.05, rtol=0.01)


@pytest.mark.parametrize(("dtype", "overrides"), [("bfloat16", {"head_dtype": "float32"}), ("float32", None)])
def test_a_half_precision_vllm_engine_computes_its_head_in_float32(dtype, overrides):
    config = RuntimeConfig(key="policy", name="m", backend="vllm", dtype=dtype, cpu_kv_cache_gb=0.25)
    for is_cpu in (True, False):
        assert engine_arguments(config, is_cpu=is_cpu).get("hf_overrides") == overrides


def test_a_kept_float32_copy_is_cast_again_only_after_its_weight_is_written():
    weight = torch.randn(8, 4).to(torch.bfloat16)
    assert float32_copy(weight) is not float32_copy(weight)  # not kept: cast at each call
    keep_float32_copy(weight)
    first = float32_copy(weight)
    assert first is float32_copy(weight) and torch.equal(first, weight.float())
    before = first.clone()
    with torch.no_grad():
        weight.copy_(torch.randn(8, 4))  # a refresh of the compute copy, a sampler's weight update
    again = float32_copy(weight)
    assert torch.equal(again, weight.float()) and not torch.equal(before, again)
    assert again.data_ptr() == first.data_ptr()  # cast into the same memory: no fresh tensor per weight version


def test_the_hf_sampler_scores_with_the_weights_it_loaded_last(tiny_model_path, tmp_path):
    """The kept float32 copy of the sampler's output layer follows a weight broadcast (`HFRuntime.load_weights`)."""
    from transformers import AutoModelForCausalLM

    from trace_rl.inference.hf import HFRuntime

    runtime = HFRuntime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf", dtype="bfloat16"))
    ids = torch.tensor([[5, 17, 99, 3, 250, 12]])
    with torch.no_grad():
        before = runtime.model(ids).logits
        updated = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
        updated.get_input_embeddings().weight.mul_(1.5)  # tied: the output layer too
        updated.save_pretrained(tmp_path)
        runtime._load_weights(str(tmp_path), 1)
        after = runtime.model(ids).logits
        use_float32_head(updated)
        expected = updated(ids).logits
    assert torch.equal(after, expected) and not torch.equal(after, before)
