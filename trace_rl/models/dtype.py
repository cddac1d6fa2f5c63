"""`model.dtype = "auto"`: bfloat16 where the hardware computes it, float32 elsewhere.

bfloat16 pays where the matrix units take it: every CUDA GPU trace-rl targets, and CPUs with
AMX (`amx_bf16`) or AVX512-BF16 (`avx512_bf16`) in /proc/cpuinfo's flags (on one such Xeon, 2
cores: a 2048² matmul at 2,005 GFLOP/s in bfloat16 against 278 in float32). A CPU without them
(AVX2 only) emulates bfloat16 at about 1 GFLOP/s: float32 there. The choice is made from the
trainer's device, so the trainer, the hf sampler and the in-process vLLM engines on one machine
all get the same dtype.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

BFLOAT16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of this machine's first CPU (empty where /proc/cpuinfo is missing: not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def choose_dtype(cuda: bool, flags: frozenset[str]) -> tuple[str, str]:
    """`auto`'s dtype for a trainer on CUDA (`cuda`) or on a CPU with these flags, and why."""
    if cuda:
        return "bfloat16", "the trainer runs on CUDA"
    present = [flag for flag in BFLOAT16_CPU_FLAGS if flag in flags]
    if present:
        return "bfloat16", f"the CPU computes bfloat16 ({', '.join(present)} in /proc/cpuinfo)"
    return "float32", f"no CUDA, and the CPU has none of {', '.join(BFLOAT16_CPU_FLAGS)} (bfloat16 would be emulated)"


@functools.cache
def resolved_dtype(dtype: str, cuda: bool) -> str:
    """`dtype` as set, or for `auto` the dtype of `choose_dtype` for a trainer on CUDA (`cuda`) or on this machine's
    CPU, logged once per process."""
    if dtype != "auto":
        return dtype
    chosen, why = choose_dtype(cuda, cpu_flags())
    logger.info("model.dtype = 'auto': %s, since %s", chosen, why)
    return chosen
