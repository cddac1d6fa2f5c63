"""`trace-rl train` on 2 persistent gloo workers: SIGKILL the run's process mid-step, the workers die with it,
and `--resume` starts new ones that end with bitwise-identical weights."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import tomli_w

from tests.flows.conftest import small_config
from tests.flows.test_crash_resume import finish, output, start, train_here, weights
from trace_rl.machine.processes import command, descendants, is_alive, stat
from trace_rl.storage import RunStorage

GONE_WITHIN_S = 15
STEPS = 2  # killed in the last one


def write_config(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.toml"
    data = small_config(str(tmp_path / "runs"), name, steps=STEPS)
    data["trainer"].update(num_processes=2, parallel="fsdp")
    path.write_text(tomli_w.dumps(data))
    return path


@pytest.mark.slow
def test_killed_run_takes_its_workers_with_it_and_resumes_bitwise(prefect_api, tmp_path):
    train_here(write_config(tmp_path, "straight"))
    expected = weights(tmp_path, "straight", STEPS)

    config = write_config(tmp_path, "killed")
    storage = RunStorage(str(tmp_path / "runs"), "killed")
    run = start(config)
    deadline = time.monotonic() + 600
    while not storage.exists(storage.step_path(2, "traces.parquet")):  # inside step 2, before its train stage
        assert run.poll() is None, f"the run ended before the kill point: {output(run)[-3000:]}"
        assert time.monotonic() < deadline, "kill point never reached"
        time.sleep(0.005)
    workers = {pid: stat(pid).start for pid in descendants(run.pid)
               if "trace_rl.trainer.rank" in command(pid) and "torch.distributed.run" not in command(pid)}
    assert len(workers) == 2, [command(pid) for pid in descendants(run.pid)]
    os.kill(run.pid, signal.SIGKILL)  # the train process alone: its workers must not outlive it
    run.wait()
    killed = time.monotonic()
    while any(is_alive(pid, start) for pid, start in workers.items()) and time.monotonic() - killed < GONE_WITHIN_S:
        time.sleep(0.1)
    assert not any(is_alive(pid, start) for pid, start in workers.items())
    assert not storage.is_stable(storage.path("weights", "000002"))

    finish(start(config, "--resume"))
    assert storage.stable_steps("weights") == [1, 2]  # ckpt.keep_weights_every = 1
    assert weights(tmp_path, "killed", STEPS) == expected
