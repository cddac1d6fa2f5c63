"""oneDNN's bfloat16 math mode around one GEMM: exact for bfloat16 values, a loss for others, and always restored."""

from __future__ import annotations

import pytest
import torch

from trace_rl.models.bfloat16_products import bfloat16_products
from trace_rl.models.dtype import cpu_flags

BFLOAT16_CPU = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
AMX = "amx_bf16" in cpu_flags()


def operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(64, 576, generator=generator), torch.randn(576, 2048, generator=generator) / 24


def test_the_setting_is_the_callers_again_after_the_block_even_when_it_raises():
    before = torch.backends.mkldnn.matmul.fp32_precision
    with bfloat16_products(True):
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    with pytest.raises(RuntimeError), bfloat16_products(True):
        raise RuntimeError("a failed GEMM")
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    with bfloat16_products(False):
        assert torch.backends.mkldnn.matmul.fp32_precision == before


@pytest.mark.skipif(not BFLOAT16_CPU, reason="oneDNN keeps float32 GEMMs in float32 on a CPU without bfloat16")
def test_bfloat16_values_keep_their_float32_products_and_other_values_are_rounded_with_amx():
    a, b = operands()
    halves = a.bfloat16().float(), b.bfloat16().float()
    exact = halves[0].double() @ halves[1].double()
    float32_error = (halves[0] @ halves[1] - exact).abs().max().item()
    with bfloat16_products(True):
        mode_error = (halves[0] @ halves[1] - exact).abs().max().item()
        rounded_error = (a @ b - a.double() @ b.double()).abs().max().item()
    # bfloat16 values: exact products, float32 sums in another order, as close to exact as float32's own GEMM
    assert mode_error < 4 * float32_error + 1e-5
    if AMX:
        # float32 values are rounded to bfloat16 first: far from their float32 GEMM, why the mode is only scoped
        assert rounded_error > 100 * float32_error
    else:
        # AVX512-BF16 alone: oneDNN runs its float32 kernel (brg_matmul:avx512_core), as close as float32's own GEMM
        assert rounded_error < 4 * float32_error + 1e-5
