"""Float32 GEMMs of bfloat16 values at the bfloat16 rate on a CPU: oneDNN's bfloat16 math mode, around one GEMM.

The float32 output layer (`float32_head`, the chunked one of `chunked_head` on a CPU, vLLM's `head_dtype =
"float32"`) multiplies float32 tensors that hold bfloat16 values: each product is exact in float32 and the sums
are float32. oneDNN's bfloat16 math mode (`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`) runs a float32
GEMM as a bfloat16 one: it rounds the inputs to bfloat16 (exact for bfloat16 values) and accumulates and writes
in float32. So for such inputs it is the same GEMM, its float32 sums in another order, at the bfloat16 rate: on
the 2-core AMX Xeon 44.7 ms against 85.3 ms for (370 x 576) x (576 x 49,152), 2.8e-5 from float64 against
4.5e-5 (bench/RESULTS-bf16.md).

The mode is the process's, not the thread's: while it is on, every float32 matmul of the process on a CPU with AMX
has its inputs rounded to bfloat16, which for other values (a float32 model's, rotary angles) is a loss. On a CPU
with AVX512-BF16 but no AMX (a Zen 5, torch 2.13) oneDNN runs its float32 kernel instead (`brg_matmul:avx512_core`,
inputs not rounded): float32's accuracy, and 2-4x the rate of torch's default float32 GEMM there (the output
layer's 681 x 576 by 576 x 24,576: 108 ms against 202 ms). So
`bfloat16_products(True)` turns it on for one GEMM and restores the setting after, and a caller passes True only
where no other thread of its process can run a float32 matmul meanwhile (the caller says why). It has no effect
on a CPU without bfloat16 instructions (oneDNN keeps float32 there) or on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def bfloat16_products(enabled: bool) -> Iterator[None]:
    """Within the block, float32 GEMMs on a CPU run oneDNN's bfloat16 kernel (`enabled`; else nothing changes).
    Only for GEMMs whose float32 inputs hold bfloat16 values, and only where nothing else runs beside them."""
    if not enabled:
        yield
        return
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before
