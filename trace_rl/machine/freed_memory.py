"""A process that keeps the memory it frees, to reuse it: glibc's malloc told not to give it back to the kernel.

A CPU trainer step allocates and frees the same large tensors every step (activations, the output layer's chunks,
the float32 gradients). glibc serves a block over its mmap threshold (128 KiB, rising to 32 MiB) with a fresh
`mmap` and gives it back with `munmap` when freed, and gives a heap's free top back past its trim threshold. So
each step touches fresh pages again: one page fault per 4 KiB, 60-180k of them in the demo's bfloat16 step (the
pages zeroed each time), and on a VM whose balloon reports free pages to its host (virtio-balloon
`VIRTIO_BALLOON_F_REPORTING`) a fault on the host too, for pages given back a while ago. On the 2-core AMX Xeon
(bench/RESULTS-bf16.md, run 17) that made the same step take 1.72-2.97 s; with nothing given back, 1.60-1.71 s
and no faults after the first two steps. The price is memory held, not used: over 100 steps of four batch shapes the
process settled at 3.99 GB by step 30, against a peak of 3.80 GB with glibc's defaults.

`keep_freed_memory()` sets `M_MMAP_MAX` to 0 (every block comes from malloc's heaps, which freed blocks return to)
and `M_TRIM_THRESHOLD` to `INT_MAX` (a heap's free top is given back only past 2 GiB): what the process has
freed stays its own, its resident memory at its peak until it exits. PyTorch's `torch.backends.xeon.run_cpu`
preloads jemalloc or tcmalloc to cut the same faults; this needs no library and no restart. It is the process's
setting, for the rest of its life, and only glibc's (Linux): elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1


@functools.cache
def keep_freed_memory() -> str:
    """Make this process keep what it frees for reuse (once; later calls return the first answer): why, or why not."""
    if platform.libc_ver()[0] != "glibc":
        return f"not glibc ({platform.system()}): malloc's defaults kept"
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, INT_MAX)):
        return "glibc refused mallopt: malloc's defaults kept"
    return "glibc's malloc keeps freed memory for reuse (M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB)"
