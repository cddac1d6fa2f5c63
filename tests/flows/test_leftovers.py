"""Nothing left behind from any entry point (issue 54): a process that runs the train flow without the `trace-rl`
command, SIGKILLed alone once its vLLM engine and torchrun trainer workers run, takes them along; so does a flow
run that `trace-rl serve` started, and the serving process goes on serving. (The `trace-rl train` process is checked in
tests/flows/test_lifecycle.py, plain processes in tests/machine/test_reaper.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tomli_w

from tests.conftest import VLLM_ENGINE
from tests.flows.conftest import small_config
from tests.flows.test_lifecycle import GONE_WITHIN_S, alive
from trace_rl.machine import temp_folders
from trace_rl.machine.processes import command, descendants, is_alive, name, start_times, stat

ROOT = Path(__file__).resolve().parents[2]
# what a library user's script (or a Prefect process worker's flow run) does: call the flow, no CLI, no reaper of its own
CALL_THE_FLOW = ("import sys; from flows.train import train_flow; from trace_rl.runs.loading import load_config; "
                 "train_flow(load_config(sys.argv[1]))")


def write_config(tmp_path: Path, name: str, model: str, steps: int = 2, **overrides) -> Path:
    config = small_config(str(tmp_path / "runs"), name, steps=steps, model={"name": model},
                          inference={"backend": "vllm", **VLLM_ENGINE}, **overrides)
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def engine_core(pid: int) -> bool:
    return name(pid).startswith("VLLM::EngineCor")


def torchrun_with_ranks(pid: int) -> bool:
    return "torch.distributed.run" in command(pid) and bool(descendants(pid))


def started(root: int, process: subprocess.Popen, *kinds, timeout: float = 300) -> list[int]:
    """A pid of each kind (a test of a pid) below `root`, once all of them run (`process`: the one whose end
    fails the wait)."""
    deadline = time.monotonic() + timeout
    while True:
        below = descendants(root)
        found = [next((pid for pid in below if kind(pid)), None) for kind in kinds]
        if None not in found:
            return found
        assert process.poll() is None, f"{process.args} ended (exit {process.returncode}) before {kinds} all ran"
        assert time.monotonic() < deadline, f"not all of {kinds} started"
        time.sleep(0.1)


def kill_alone_and_check_nothing_is_left(pid: int) -> None:
    """SIGKILL `pid` alone (as the OOM killer does) and check that none of its processes outlives it, nor any of
    its temp folders."""
    tree = start_times(descendants(pid))
    assert temp_folders.left_by(pid)  # its vLLM engine's, at least
    time.sleep(0.5)  # the reaper records what runs four times a second
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while (alive(tree) or temp_folders.left_by(pid)) and time.monotonic() - killed < GONE_WITHIN_S:
        time.sleep(0.1)
    left = [f"{command(pid)} (pid {pid})" for pid, start in tree.items() if is_alive(pid, start)]
    assert not left, f"still alive {GONE_WITHIN_S} s after the kill: {left}"
    assert not temp_folders.left_by(pid)  # its engine's sockets and log, its workers' private config


@pytest.mark.slow
def test_a_script_calling_the_train_flow_takes_its_engine_and_workers_along_when_killed(prefect_api, tmp_path,
                                                                                      tiny_model_path):
    config = write_config(tmp_path, "called", tiny_model_path, steps=4,
                          trainer={"lr": 1e-3, "micro_batch_tokens": 1024, "num_processes": 2, "device": "cpu"})
    with open(tmp_path / "called.log", "w") as log:
        script = subprocess.Popen([sys.executable, "-c", CALL_THE_FLOW, str(config)], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, process_group=0)
    try:
        started(script.pid, script, engine_core, torchrun_with_ranks)  # the workers start at step 1's training
        kill_alone_and_check_nothing_is_left(script.pid)
    finally:
        with_group_killed(script)


def deployment_id(api_url: str, deployment: str, server: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        found = httpx.post(f"{api_url}/deployments/filter", timeout=10,
                           json={"deployments": {"name": {"any_": [deployment]}}}).json()
        if found:
            return found[0]["id"]
        assert server.poll() is None, f"trace-rl serve exited {server.returncode}"
        assert time.monotonic() < deadline, f"trace-rl serve never served {deployment}"
        time.sleep(0.5)


def start_flow_run(api_url: str, deployment: str, server: subprocess.Popen) -> str:
    url = f"{api_url}/deployments/{deployment_id(api_url, deployment, server)}/create_flow_run"
    deadline = time.monotonic() + 60
    while (response := httpx.post(url, json={}, timeout=10)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(1)  # the session's Prefect server, busy under the suite's load, asks to come back
    response.raise_for_status()
    return response.json()["id"]


def final_state(api_url: str, flow_run: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(f"{api_url}/flow_runs/{flow_run}", timeout=10).json()["state"]
        if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        assert time.monotonic() < deadline, f"the flow run {flow_run} is still {state['name']}"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_flow_run_of_serve_killed_leaves_nothing_and_serve_goes_on(prefect_api, tmp_path, tiny_model_path):
    config = write_config(tmp_path, "served", tiny_model_path)
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(config)], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, process_group=0)
    try:
        killed_run = start_flow_run(prefect_api, "served", server)
        (engine,) = started(server.pid, server, engine_core)
        flow_run_process = stat(engine).ppid  # the engine's parent: the flow run's process
        assert flow_run_process != server.pid
        kill_alone_and_check_nothing_is_left(flow_run_process)
        assert server.poll() is None, "trace-rl serve died with its flow run"
        assert final_state(prefect_api, killed_run)["type"] == "CRASHED"
        # still serving: the next flow run (an eval of a config without [eval]) runs and fails, refused in one line
        state = final_state(prefect_api, start_flow_run(prefect_api, "served-eval", server))
        assert state["type"] == "FAILED" and "no [eval] section" in state["message"], state
    finally:
        with_group_killed(server)


def with_group_killed(process: subprocess.Popen) -> None:
    """End what a test started, its process group with it (nothing of it may outlive the test)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(30)
