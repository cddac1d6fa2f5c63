"""A newcomer's first hour (issue 19), with real `trace-rl` processes and the real Prefect server: a SIGKILLed
run leaves no process behind, its resume marks the killed flow runs Crashed, refusals are one line with
exit code 2 and no flow run, and a run's output is quiet and says where things are. The SIGKILL is checked on the
run tests/flows/test_engine_death.py kills its engine in (`assert_killed_run_leaves_no_process_then_resume_takes_over`),
so one run with its engine pays for both."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import tomli_w

from tests.flows.conftest import small_config
from tests.flows.test_crash_resume import ROOT, finish, output, start
from trace_rl.machine import temp_folders
from trace_rl.machine.processes import descendants, is_alive, name, start_times
from trace_rl.storage import RunStorage

GONE_WITHIN_S = 15


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def flow_runs(api_url: str, name: str) -> list[dict]:
    response = httpx.post(f"{api_url}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}}}, timeout=10)
    response.raise_for_status()
    return response.json()


def flow_run_count(api_url: str) -> int:
    return httpx.post(f"{api_url}/flow_runs/count", json={}, timeout=10).json()


def assert_refused(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_refusals_are_one_message_with_exit_code_2_and_no_flow_run(prefect_api, tmp_path):
    from trace_rl.config import config_to_toml
    from trace_rl.runs.loading import validate_config
    from trace_rl.version import VERSION_FILE, version_record

    config = tmp_path / "existing.toml"
    config.write_text(tomli_w.dumps(small_config(str(tmp_path / "runs"), "existing")))
    (tmp_path / "runs" / "existing").mkdir(parents=True)
    (tmp_path / "runs" / "existing" / "config.toml").write_text(
        config_to_toml(validate_config(small_config(str(tmp_path / "runs"), "existing"))))
    (tmp_path / "runs" / "existing" / VERSION_FILE).write_bytes(version_record())  # a run of this release
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "batch.parquet").write_text("an earlier replay")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text(tomli_w.dumps({**small_config(str(tmp_path / "runs"), "unknown"), "stpes": 3}))
    before = flow_run_count(prefect_api)

    assert_refused(cli("train", str(config)), "pass --resume to continue it or --overwrite")
    assert_refused(cli("replay", "--run", str(tmp_path / "runs" / "existing"), "--algorithms", '["grpo"]',
                       "--out", str(tmp_path / "out")), "is not empty; choose a new directory or pass --overwrite")
    assert_refused(cli("train", str(unknown)), "stpes: unknown key; did you mean 'steps'?")
    assert flow_run_count(prefect_api) == before


def engine_started(process: subprocess.Popen) -> bool:
    """Whether a vLLM EngineCore process runs under `process`."""
    return any(name(pid).startswith("VLLM::EngineCor") for pid in descendants(process.pid))


def alive(started: dict[int, int]) -> list[str]:
    return [f"{name(pid)} (pid {pid})" for pid, start in started.items() if is_alive(pid, start)]


def assert_killed_run_leaves_no_process_then_resume_takes_over(api_url: str, config, storage: RunStorage,
                                                                steps: int) -> subprocess.Popen:
    """Resume the run at `config` (of `steps` steps, on the vLLM sampler), SIGKILL its `trace-rl train` process
    alone as soon as its last step's flow run is on the server, and check that no process of it outlives it by
    `GONE_WITHIN_S`. Then resume it to its end: the new flow run takes the killed ones over (marked Crashed, naming
    both), and its output is quiet and says where things are. Returns the finished resume
    (tests/flows/test_engine_death.py runs this after killing the same run's engine twice)."""
    run_name = storage.name
    earlier = {r["id"] for r in flow_runs(api_url, run_name) + flow_runs(api_url, f"{run_name}-step-{steps}")}
    run = start(config, "--resume")
    # killed as soon as this process's flow run of the last step is on the server and its engine has started:
    # waiting for its sampling to show as engine CPU time could take longer than the step under load, and the kill
    # then landed after its weights
    deadline = time.monotonic() + 300
    while not ([r for r in flow_runs(api_url, f"{run_name}-step-{steps}") if r["id"] not in earlier]
               and engine_started(run)):
        assert run.poll() is None, f"the run ended before step {steps}'s flow run: {output(run)[-3000:]}"
        assert time.monotonic() < deadline, f"step {steps}'s flow run never came"
        time.sleep(0.02)
    started = start_times(descendants(run.pid))
    assert any(name(pid).startswith("VLLM::EngineCor") for pid in started), [name(pid) for pid in started]
    assert temp_folders.left_by(run.pid)
    os.kill(run.pid, signal.SIGKILL)  # the train process alone, not its process group
    run.wait()
    killed = time.monotonic()
    assert steps not in storage.stable_steps("weights")  # the kill landed inside the last step
    while (alive(started) or temp_folders.left_by(run.pid)) and time.monotonic() - killed < GONE_WITHIN_S:
        time.sleep(0.1)
    assert not alive(started), f"still alive {GONE_WITHIN_S} s after the kill: {alive(started)}"
    assert not temp_folders.left_by(run.pid)  # its engine's sockets and log
    unfinished = lambda runs: [r for r in runs if r["state"]["type"] in ("RUNNING", "PENDING")]
    (old,) = unfinished(r for r in flow_runs(api_url, run_name) if r["id"] not in earlier)
    step_runs = flow_runs(api_url, f"{run_name}-step-{steps}")
    assert len(unfinished(step_runs)) == 1, [(r["name"], r["state"]["type"]) for r in step_runs]
    (old_step,) = unfinished(step_runs)

    resumed = start(config, "--resume")
    finish(resumed)
    assert not temp_folders.left_by(resumed.pid)  # an exit removes them
    new = [r for r in flow_runs(api_url, run_name) if r["id"] not in earlier | {old["id"]}]
    assert [r["state"]["name"] for r in new] == ["Completed"]
    for killed_run in (old, old_step):
        state = httpx.get(f"{api_url}/flow_runs/{killed_run['id']}", timeout=10).json()["state"]
        assert state["name"] == "Crashed", state
        assert f"pid {run.pid}" in state["message"] and f"taken over by flow run {new[0]['id']}" in state["message"]

    # the resumed run's output: quiet (one line per step, no tracebacks) and it says where things are
    text = output(resumed)
    assert "Traceback" not in text, text[-3000:]
    assert re.search(rf"^step {steps}/{steps}: reward [0-9.]+, entropy", text, re.MULTILINE), text[-3000:]
    assert f"run directory:      {storage.url}" in text, text[-2000:]
    assert f"weights of step {steps}:  {storage.url_of('weights', f'{steps:06d}')}" in text, text[-2000:]
    assert f"this run in the UI: {api_url.removesuffix('/api')}/runs/flow-run/{new[0]['id']}" in text
    return resumed


@pytest.mark.slow
def test_server_start_marks_the_flow_runs_of_dead_processes_crashed(prefect_api, tmp_path):
    from trace_rl.machine.processes import identity

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    process = identity(gone.pid)  # taken while it runs, as a flow run labels itself
    gone.wait()
    flow = created(f"{prefect_api}/flows/", {"name": "train"})
    labels = {"trace-rl.run": str(tmp_path / "runs" / "ghost"), **{f"trace-rl.{k}": v for k, v in process.items()}}
    ghost = flow_run(prefect_api, flow["id"], "ghost", {"type": "RUNNING"}, labels=labels)
    alive_labels = {**labels, **{f"trace-rl.{k}": v for k, v in identity().items()}}  # this process: alive
    living = flow_run(prefect_api, flow["id"], "living", {"type": "RUNNING"}, labels=alive_labels)

    # train_step subflows send no heartbeat: one whose parent ended Crashed (on another machine, by the heartbeat
    # automation) is an orphan; one whose parent is alive is not
    orphan = subflow(prefect_api, "ghost-step-3", parent=flow_run(prefect_api, flow["id"], "crashed-elsewhere",
                                                                 {"type": "CRASHED"}))
    child = subflow(prefect_api, "living-step-1", parent=living)

    result = cli("server", "start")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"marked the flow run ghost ({ghost['id']}) Crashed" in result.stdout
    assert f"marked the subflow run ghost-step-3 ({orphan['id']}) Crashed" in result.stdout, result.stdout
    state = httpx.get(f"{prefect_api}/flow_runs/{orphan['id']}", timeout=10).json()["state"]
    assert state["name"] == "Crashed" and "parent flow run crashed-elsewhere ended Crashed" in state["message"], state
    assert httpx.get(f"{prefect_api}/flow_runs/{child['id']}", timeout=10).json()["state"]["name"] == "Running"
    state = httpx.get(f"{prefect_api}/flow_runs/{ghost['id']}", timeout=10).json()["state"]
    assert state["name"] == "Crashed" and f"pid {gone.pid}" in state["message"] and "server start" in state["message"]
    assert httpx.get(f"{prefect_api}/flow_runs/{living['id']}", timeout=10).json()["state"]["name"] == "Running"
    for run in (living, child):
        httpx.post(f"{prefect_api}/flow_runs/{run['id']}/set_state", timeout=10,
                   json={"state": {"type": "CANCELLED"}, "force": True}).raise_for_status()


def created(url: str, body: dict) -> dict:
    """POST `body` to `url` and return what the server made. A busy server's answer (429, 502, 503) is tried again
    twice, as Prefect's client does; any other refusal fails naming the server's answer."""
    for _ in range(3):
        response = httpx.post(url, json=body, timeout=10)
        if response.status_code not in (429, 502, 503):
            break
        time.sleep(1)
    assert response.is_success, f"POST {url}: {response.status_code} {response.text[:500]}"
    return response.json()


def flow_run(api_url: str, flow_id: str, name: str, state: dict, **fields) -> dict:
    return created(f"{api_url}/flow_runs/", {"flow_id": flow_id, "name": name, "state": state, **fields})


def subflow(api_url: str, name: str, parent: dict) -> dict:
    """A running `train_step` flow run under `parent`, tied to it by a task run, as Prefect ties subflows."""
    task = created(f"{api_url}/task_runs/",
                   {"flow_run_id": parent["id"], "task_key": "train_step", "dynamic_key": name, "name": name})
    flow = created(f"{api_url}/flows/", {"name": "train_step"})
    return flow_run(api_url, flow["id"], name, {"type": "RUNNING"}, parent_task_run_id=task["id"])


def test_the_train_flow_on_a_finished_run_says_so_and_runs_no_step(prefect_api, tmp_path, capsys):
    """What the `train/<name>` deployment (mode = resume) does when started again on a finished run: the same
    message `trace-rl train --resume` prints, and no step subflow."""
    from flows.train import train_flow
    from tests.flows.test_pipeline import step_runs
    from trace_rl.runs.loading import validate_config

    config = validate_config(small_config(str(tmp_path / "runs"), "finished-flow"))
    storage = RunStorage(config.storage, config.name)
    for kind in ("checkpoints", "weights"):
        storage.mark_stable(storage.path(kind, "000002"))
    assert train_flow(config, mode="resume") == []
    assert (f"finished-flow is already finished: all 2 steps are trained ({storage.url}); nothing to do. To train "
            "on, raise steps: --resume --set steps=N with N > 2") in " ".join(capsys.readouterr().err.split())
    assert step_runs(prefect_api, "finished-flow") == []
