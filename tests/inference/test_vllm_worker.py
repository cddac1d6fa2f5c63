"""Loading the worker extension in a process vLLM starts makes it exit without the interpreter's final garbage
collection (trace_rl/inference/vllm_worker.py says why); the process that runs the engine keeps its own."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

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
