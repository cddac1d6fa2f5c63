"""Loading the worker extension in a process vLLM starts makes it exit without the interpreter's final garbage
collection (trace_rl/inference/vllm_worker.py says why); the process that runs the engine keeps its own."""

from __future__ import annotations

import asyncio
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def record_freeze_count_at_exit(path: str) -> None:
    """Registered before the extension is loaded, so it runs after the extension's exit hook (atexit runs the
    last registered first): what the interpreter's final collection will find frozen."""
    import atexit
    import gc

    atexit.register(lambda: Path(path).write_text(str(gc.get_freeze_count())))
    import trace_rl.inference.vllm_worker  # noqa: F401 - loaded as vLLM loads it in its workers


def test_a_process_vllm_starts_freezes_its_heap_at_exit_and_the_main_process_does_not(tmp_path):
    child = tmp_path / "child"
    process = multiprocessing.get_context("spawn").Process(target=record_freeze_count_at_exit, args=(str(child),),
                                                           name="VllmWorker-0")
    process.start()
    process.join(120)
    assert process.exitcode == 0
    assert int(child.read_text()) > 1000  # the whole heap: modules, functions, ...

    main = tmp_path / "main"
    script = f"from tests.inference.test_vllm_worker import record_freeze_count_at_exit as r; r({str(main)!r})"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert main.read_text() == "0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllms_rms_norm_kernels_on_cpu_agree_with_its_native_norm(dtype):
    import vllm._custom_ops  # noqa: F401 - loads the kernels
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from trace_rl.inference.vllm_worker import _KernelNorm

    generator = torch.Generator().manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(576, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=generator))
    x = (torch.randn(32, 576, generator=generator) * 3).to(dtype)
    residual = torch.randn(32, 576, generator=generator).to(dtype)
    kernel = _KernelNorm(norm)
    ulp = 1e-6 if dtype == torch.float32 else 0.0625  # one bfloat16 step at the outputs' largest, 8-16
    torch.testing.assert_close(kernel(x.clone()), norm.forward_native(x.clone()), rtol=0, atol=ulp)
    (out, added), (native_out, native_added) = kernel(x.clone(), residual.clone()), norm.forward_native(
        x.clone(), residual.clone())
    torch.testing.assert_close(added, native_added, rtol=0, atol=0)  # the residual stream: x + residual, the same
    torch.testing.assert_close(out, native_out, rtol=0, atol=ulp)
    wider = x.float()  # a float32 input to a bfloat16 norm: the native norm's own path
    if dtype == torch.bfloat16:
        torch.testing.assert_close(kernel(wider), norm.forward_native(wider), rtol=0, atol=0)


def test_an_idle_cpu_worker_sleeps_instead_of_spinning_after_a_request(vllm_runtime):
    """vLLM's worker spins 1 s after each request it reads (CPU_WORKER_SPIN_SECONDS says why not here): on a 2-core
    machine that spin took 0.2-0.3 CPU seconds from the trainer step that follows sampling."""
    from trace_rl.inference.vllm_worker import CPU_WORKER_SPIN_SECONDS

    (engine_core,) = vllm_runtime.worker._processes()
    workers = [p for p in psutil.Process(engine_core.pid).children(recursive=True) if "Worker" in " ".join(p.cmdline())]
    assert workers

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in workers)

    asyncio.run(vllm_runtime.generate([5, 6, 7], temperature=1.0, max_tokens=4, seed=0))
    time.sleep(CPU_WORKER_SPIN_SECONDS + 0.1)
    before = cpu_seconds()
    time.sleep(0.5)  # inside vLLM's own 1 s of spinning, which takes a core's share: 0.25-0.5 s of CPU time here
    assert cpu_seconds() - before < 0.05
