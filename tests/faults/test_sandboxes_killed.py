"""A `trace-rl train` of a verifiers env whose rewards run programs in the sandbox, SIGKILLed in a step while its
sandboxes run (each program with a daemon of its own): nothing of them is left (no process, no mount namespace,
and once `--resume` has run, no working folder), and the resumed run ends with the weights of an uninterrupted one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import tomli_w

from tests.bitwise import weights_bytes, weights_difference
from tests.flows.conftest import small_config
from tests.flows.test_crash_resume import finish, output, start, train_here
from trace_rl.machine.processes import command, descendants, is_alive, stat
from trace_rl.sandbox import bwrap_lack
from trace_rl.sandbox.sandbox import default_root
from trace_rl.storage import RunStorage

pytestmark = [pytest.mark.faults, pytest.mark.slow,
              pytest.mark.skipif(bwrap_lack() is not None, reason=f"the sandbox needs {bwrap_lack()}")]

STEPS = 2  # killed in the last one
GONE_WITHIN_S = 15
TASKSETS = str(Path(__file__).parent / "tasksets")


def write_config(tmp_path: Path, name: str) -> tuple[Path, RunStorage]:
    env = [{"id": "verifiers", "batch_size": 2, "group_size": 4, "import_paths": [TASKSETS],
            "args": {"taskset": {"id": "scored_replies"}}}]
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(small_config(str(tmp_path / "runs"), name, steps=STEPS, env=env)))
    return path, RunStorage(str(tmp_path / "runs"), name)


def mount_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def sandboxed(run: int) -> dict[int, int]:
    """pid -> start time of every process in the run's sandboxes: its bwrap processes and all below them."""
    found = {}
    for pid in descendants(run):
        if command(pid).startswith("bwrap "):
            for inside in [pid, *descendants(pid)]:
                if (status := stat(inside)) is not None:
                    found[inside] = status.start
    return found


def test_a_run_killed_with_sandboxes_running_leaves_none_and_resumes_bitwise(prefect_api, tmp_path):
    straight, straight_storage = write_config(tmp_path, "straight")
    train_here(straight)

    config, storage = write_config(tmp_path, "killed")
    run = start(config)
    deadline = time.monotonic() + 600
    while True:  # inside step 2, a daemon of a sandboxed program running
        assert run.poll() is None, f"the run ended before the kill point: {output(run)[-3000:]}"
        assert time.monotonic() < deadline, "kill point never reached"
        if storage.exists(storage.step_path(1, "traces.parquet")):
            inside = sandboxed(run.pid)
            # read while they run: a program's sandbox (its daemon, mounts and folder) ends with it, within a second
            namespaces = {mount_namespace(pid) for pid in inside} - {None, mount_namespace(os.getpid())}
            folders = sorted(default_root().glob(f"{run.pid}-*"))
            if any(command(pid) == "sleep 600" for pid in inside) and namespaces and folders:
                break
        time.sleep(0.005)
    os.kill(run.pid, signal.SIGKILL)  # the train process alone: its sandboxes must not outlive it
    run.wait()
    killed = time.monotonic()
    while any(is_alive(pid, start) for pid, start in inside.items()) and time.monotonic() - killed < GONE_WITHIN_S:
        time.sleep(0.1)
    assert not [command(pid) for pid, start in inside.items() if is_alive(pid, start)]
    # a mount namespace lives as long as a process in it: the sandboxes' mounts are gone with their processes
    assert not {mount_namespace(int(pid)) for pid in os.listdir("/proc") if pid.isdigit()} & namespaces
    assert not storage.is_stable(storage.path("weights", "000002"))

    resumed = start(config, "--resume")
    finish(resumed)
    assert not [folder for folder in folders if folder.exists()]  # the resumed run's first sandbox swept them
    assert not list(default_root().glob(f"{resumed.pid}-*"))
    assert storage.stable_steps("weights") == [1, 2]  # ckpt.keep_weights_every = 1
    assert (why := weights_difference(storage, straight_storage, STEPS)) is None, why
    assert weights_bytes(storage, STEPS) != weights_bytes(storage, 1)  # the sandboxes' rewards trained step 2
