"""The chunked output layer against the float32 head's full log-softmax: logprobs, entropies and gradients."""

from __future__ import annotations

import pytest
import torch

from trace_rl.models.chunked_head import chunked_logprobs, vocabulary_chunk
from trace_rl.models.float32_head import float32_logits


def reference(hidden, weight, targets, temperature, softcap=None):
    """Today's path: float32 logits of the whole vocabulary (`float32_logits`), then log_softmax."""
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    head.weight = torch.nn.Parameter(weight)
    logits = float32_logits(head, hidden, hidden.dtype)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy.detach(), head.weight


def problem(dtype, positions=37, vocab=1000, width=48, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(positions, width, generator=generator) * 2).to(dtype)
    weight = (torch.randn(vocab, width, generator=generator) / 2).to(dtype)
    targets = torch.randint(0, vocab, (positions,), generator=generator)
    targets[:3] = torch.tensor([0, vocab - 1, 256])  # the first and last columns, a chunk's first
    temperature = torch.where(torch.arange(positions) % 3 == 0, 0.7, 1.0)
    upstream = torch.randn(positions, generator=generator)
    return hidden, weight, targets, temperature, upstream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("bfloat16_gemms", [False, True])
def test_chunked_logprobs_equal_the_float32_heads(dtype, softcap, bfloat16_gemms):
    hidden, weight, targets, temperature, upstream = problem(dtype)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp_ref, entropy_ref, head_weight = reference(h_ref, w_ref, targets, temperature, softcap)
    (lp_ref * upstream).sum().backward()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    # 256 columns: four chunks, the last one short (1000 = 3 x 256 + 232)
    precision = torch.backends.mkldnn.matmul.fp32_precision
    lp, entropy = chunked_logprobs(h, w, targets, temperature, softcap=softcap, columns=256,
                                   bfloat16_gemms=bfloat16_gemms)
    (lp * upstream).sum().backward()
    assert torch.backends.mkldnn.matmul.fp32_precision == precision  # the math mode only around the GEMMs
    assert lp.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
    # the same float32 logits (exact products of the rounded inputs) up to summation order
    torch.testing.assert_close(lp, lp_ref.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(entropy, entropy_ref, rtol=0, atol=2e-5)
    assert h.grad.dtype == w.grad.dtype == dtype
    # the backward GEMMs run in the compute dtype, as the float32 head's do: bfloat16 rounding there
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for mine, theirs in ((h.grad, h_ref.grad), (w.grad, head_weight.grad)):
        error = (mine.float() - theirs.float()).norm() / theirs.float().norm()
        assert error < tolerance


def test_one_chunk_and_many_agree():
    hidden, weight, targets, temperature, _ = problem(torch.float32)
    whole = chunked_logprobs(hidden, weight, targets, temperature, columns=1000)
    chunked = chunked_logprobs(hidden, weight, targets, temperature, columns=256)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_frozen_output_layer_gets_no_gradient():
    hidden, weight, targets, temperature, upstream = problem(torch.bfloat16)
    h = hidden.clone().requires_grad_()
    lp, _ = chunked_logprobs(h, weight, targets, temperature, columns=256)
    (lp * upstream).sum().backward()
    assert h.grad is not None and weight.grad is None


def test_the_vocabulary_chunk_fits_the_devices_budget():
    assert vocabulary_chunk(110, 151936, "cpu") == 151936  # 110 x 151,936 < 2^24
    assert vocabulary_chunk(4096, 151936, "cpu") == 4096
    assert vocabulary_chunk(16384, 151936, "cuda") == 32768
    assert vocabulary_chunk(10**6, 151936, "cpu") == 256  # at least one aligned tile
