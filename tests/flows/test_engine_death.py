"""A real `trace-rl train` on the vLLM sampler whose EngineCore is SIGKILLed: the run fails fast, naming
the engine, and `--resume` finishes it with the weights of a run that was never interrupted (issue 20). The same
run, resumed, is then SIGKILLed itself: it leaves no process behind, and its next resume marks the killed flow runs
Crashed and says where things are (issue 19, tests/flows/test_lifecycle.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.bitwise import weights_difference
from tests.conftest import VLLM_ENGINE
from tests.flows.conftest import small_config
from tests.flows.test_crash_resume import output, start, train_here
from tests.flows.test_lifecycle import (
    assert_killed_run_leaves_no_process_then_resume_takes_over,
    assert_refused,
    cli,
    engine_started,
)
from trace_rl.storage import RunStorage

STEPS = 3
FAIL_WITHIN_S = 60


def write_config(tmp_path: Path, name: str, steps: int = STEPS, completion_tokens: int = 256) -> Path:
    """A vLLM run whose steps sample for seconds (32 rollouts of 256 tokens), so a kill lands inside it."""
    import tomli_w

    data = small_config(str(tmp_path / "runs"), name, steps=steps, inference={"backend": "vllm", **VLLM_ENGINE},
                        sampling={"max_completion_tokens": completion_tokens})
    data["env"] = [{"id": "reverse-text", "batch_size": 4, "group_size": 8}]
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(data))
    return path


def engine_core_pid(parent: int) -> int | None:
    """The pid of the EngineCore child of `parent`, from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and (b"EngineCore" in cmdline or "EngineCore" in stat):
            return int(entry.name)
    return None


def engine_cpu_seconds(parent: int) -> float:
    """CPU time used so far by the vLLM processes under `parent` (the engine works only while it samples)."""
    from trace_rl.machine.processes import descendants, name

    ticks = 0
    for pid in descendants(parent):
        if name(pid).startswith("VLLM::"):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def sampling(process: subprocess.Popen, storage: RunStorage, step: int, api_url: str | None = None):
    """A `ready()` for the sampling of `step`: the step before it has finished (its metrics.json is written after
    its broadcast, so the engine's next work is this step's sampling), with `api_url` the step's flow run is on
    the Prefect server, and the engine has since worked for 0.1 CPU-seconds (an idle engine uses next to none).
    The sampling of a later step takes about a second here: waiting for the flow run can miss it."""
    baseline: list[float] = []
    previous = storage.step_path(step - 1, "metrics.json")
    flow_run = {"flow_runs": {"name": {"any_": [f"{storage.name}-step-{step}"]}}}

    def ready() -> bool:
        if not baseline:
            if storage.exists(previous) and (
                    api_url is None or httpx.post(f"{api_url}/flow_runs/filter", json=flow_run, timeout=5).json()):
                baseline.append(engine_cpu_seconds(process.pid))
            return False
        return engine_cpu_seconds(process.pid) - baseline[0] > 0.1

    return ready


def kill_engine_when(process: subprocess.Popen, ready, what: str) -> str:
    """SIGKILL the run's EngineCore once `ready()` holds; the run must then exit non-zero within 60 s.
    Returns its stderr."""
    deadline = time.monotonic() + 300
    while not ready():
        assert process.poll() is None, f"the run ended before {what}: {output(process)[-3000:]}"
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.02)
    pid = engine_core_pid(process.pid)
    assert pid is not None, "no EngineCore process under the run"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
        process.wait(timeout=FAIL_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"the run still waited {FAIL_WITHIN_S}s after its engine was killed {what}") from None
    assert time.monotonic() - killed < FAIL_WITHIN_S
    assert process.returncode != 0, f"the run exited 0 after its engine was killed {what}"
    return output(process)


@pytest.mark.slow
@pytest.mark.vllm
def test_engine_killed_then_run_sigkilled_each_resumed_bitwise_leaving_no_process(prefect_api, tmp_path, shared_vllm):
    train_here(write_config(tmp_path, "straight"))  # on the session's engine of the same settings: none to start

    config = write_config(tmp_path, "engine-killed")  # a name no other test's flow runs have on the server
    storage = RunStorage(str(tmp_path / "runs"), "engine-killed")
    run = start(config)
    # while its engine starts (20-40 s), a second process for the same run is refused
    deadline = time.monotonic() + 300
    while not engine_started(run):
        assert run.poll() is None and time.monotonic() < deadline, output(run)[-3000:]
        time.sleep(0.02)
    assert_refused(cli("train", str(config), "--resume"), f"is being trained right now by process {run.pid}")

    err = kill_engine_when(run, sampling(run, storage, 2), "while step 2 sampled")
    assert "vLLM engine for 'policy'" in err and "died" in err, err[-3000:]
    assert not storage.exists(storage.step_path(2, "traces.parquet"))  # the kill landed inside the sampling

    # the broadcast of step 2 starts as its weights become STABLE: the reload meets a dead engine
    err = kill_engine_when(start(config, "--resume"), lambda: storage.is_stable(storage.path("weights", "000002")),
                           "at the weight reload after step 2")
    assert "vLLM engine for 'policy'" in err, err[-3000:]

    resumed = assert_killed_run_leaves_no_process_then_resume_takes_over(prefect_api, config, storage, STEPS)
    assert storage.stable_steps("weights") == [1, 2, 3]  # ckpt.keep_weights_every = 1
    assert (why := weights_difference(storage, RunStorage(str(tmp_path / "runs"), "straight"))) is None, why
    assert "Failed to load weights" not in output(resumed), output(resumed)[-3000:]  # the reload after a resume
