"""A script that samples with the in-process vLLM engine and never stops it exits all the same, its engine's
processes and temp folder with it: the engine stops at exit before multiprocessing joins its children."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import VLLM_ENGINE
from trace_rl.machine import temp_folders
from trace_rl.machine.processes import is_alive

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
EXIT_WITHIN_S = 180  # an engine start on 2 loaded cores, a few tokens, its stop
# a weakref finalizer made before multiprocessing is imported (as a larger script's imports may make one) puts
# weakref's exit handler, which runs vLLM's finalizers, after multiprocessing's: its join of the engine core
# then waited on a process that nothing would stop
SAMPLES_THEN_EXITS = f"""
import sys, weakref
class Anchor: pass
anchor = Anchor()
weakref.finalize(anchor, print, "finalized")
assert "multiprocessing.util" not in sys.modules
import asyncio
from trace_rl.inference.vllm_engine import VLLMEngineRuntime
from trace_rl.models.runtime import RuntimeConfig
runtime = VLLMEngineRuntime(RuntimeConfig(key="exit", name=sys.argv[1], backend="vllm", **{VLLM_ENGINE!r}))
generation = asyncio.run(runtime.generate([5, 6, 7], temperature=1.0, max_tokens=4, seed=0))
from trace_rl.machine.processes import stat
engine = [f"{{process.pid}}:{{stat(process.pid).start}}" for process in runtime.worker._processes()]
print(len(generation.token_ids), runtime.worker.folder, *engine, flush=True)
"""


def test_a_script_that_never_stops_its_engine_exits_and_leaves_nothing(tiny_model_path):
    script = subprocess.Popen([sys.executable, "-c", SAMPLES_THEN_EXITS, tiny_model_path], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        out, _ = script.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        script.kill()
        out, _ = script.communicate()
        pytest.fail(f"the script did not exit {EXIT_WITHIN_S} s after it started; it printed {out!r}")
    assert script.returncode == 0, out
    sampled, folder, *engine, finalized = out.split()
    assert sampled == "4" and finalized == "finalized" and engine
    assert not any(is_alive(*map(int, process.split(":"))) for process in engine)
    assert not Path(folder).exists() and temp_folders.left_by(script.pid) == []
