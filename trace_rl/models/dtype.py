"""`model.dtype = "auto"`: per side (the trainer, the samplers), bfloat16 where it is the faster, float32 elsewhere.

The rules, from measurements:

- CUDA (the trainer's device): bfloat16 on both sides, every GPU trace-rl targets has bfloat16
  tensor cores.
- A CPU with AMX (`amx_bf16` in /proc/cpuinfo's flags): bfloat16 on both sides. On a 2-core
  Xeon a 2048² matmul ran at 2,005 GFLOP/s in bfloat16 against 278 in float32; vLLM sampled 2x
  faster and the trainer stepped 1.1-1.3x faster (2026-11-26); on `make demo`'s short completions
  sampling was 1.02-1.21x float32's and the trainer 0.96-2.13x in three runs
  (2026-11-28, `bench.demo_dtype`, under loads of 3 to 6 on 2 cores): not slower beyond the load's
  noise, which is all the rule needs.
- A CPU with AVX512-BF16 but no AMX (Zen 4/5): bfloat16 for the trainer, float32 for the
  samplers. On a 2-core Zen 5 (bfloat16 matmuls at 928-998 GFLOP/s, 2026-11-29) `make demo`'s
  step was 1.38x float32's so. With bfloat16 samplers too it was 1.85x (vLLM sampled
  1.3-1.5x faster in bfloat16) but learned less: over seeds 0-2 the mean reward of the last 5
  of 10 steps was -0.01 to +0.16 above the first 5's, against +0.11 to +0.26 with float32
  samplers, and the sampler-trainer gap was larger (bench/RESULTS-bf16.md, run 15).
- A CPU without either (AVX2 only, Arm) emulates bfloat16 at about 1 GFLOP/s: float32, bit for
  bit what `float32` runs.

The sides may differ: the sampler then loads the trainer's exported bfloat16 weights in
float32 (exactly), and the importance ratio and the mismatch metrics compare the logprobs each
side computed, as with any sampler-trainer difference. The choice is made from the trainer's
device and this machine's flags, and logged once per side with its reason.
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


SIDES = ("trainer", "sampler")


def choose_dtype(cuda: bool, flags: frozenset[str], side: str = "trainer") -> tuple[str, str]:
    """`auto`'s dtype for the `side` ("trainer" or "sampler") of a run whose trainer is on CUDA (`cuda`) or on a CPU
    with these flags, and why."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if cuda:
        return "bfloat16", "the trainer runs on CUDA"
    present = [flag for flag in BFLOAT16_CPU_FLAGS if flag in flags]
    if "amx_bf16" in present:
        return "bfloat16", f"the CPU computes bfloat16 ({', '.join(present)} in /proc/cpuinfo)"
    if present and side == "sampler":
        return "float32", ("the CPU has avx512_bf16 but no amx_bf16: `make demo` learned less with bfloat16 samplers "
                           "there (bench/RESULTS-bf16.md, run 15)")
    if present:
        return "bfloat16", f"the CPU computes bfloat16 ({', '.join(present)} in /proc/cpuinfo)"
    return "float32", f"no CUDA, and the CPU has none of {', '.join(BFLOAT16_CPU_FLAGS)} (bfloat16 would be emulated)"


@functools.cache
def resolved_dtype(dtype: str, cuda: bool, side: str = "trainer") -> str:
    """`dtype` as set, or for `auto` the dtype of `choose_dtype` for the `side` of a run whose trainer is on CUDA
    (`cuda`) or on this machine's CPU, logged once per process and side."""
    if dtype != "auto":
        return dtype
    chosen, why = choose_dtype(cuda, cpu_flags(), side)
    logger.info("model.dtype = 'auto' for the %s: %s, since %s", side, chosen, why)
    return chosen
