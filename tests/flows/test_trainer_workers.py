"""The train flow with `trainer.num_processes = 2`: the run's persistent workers train every step as one process
does; a `trace-rl train` on them SIGKILLed mid-step takes its workers with it, and `--resume` starts new ones that
end with bitwise-identical weights."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import tomli_w
from safetensors.torch import load, load_file

from tests.bitwise import weights_difference
from tests.flows.conftest import small_config
from tests.flows.test_crash_resume import finish, output, start
from trace_rl.machine import processes
from trace_rl.machine.processes import command, descendants, is_alive, start_times
from trace_rl.pipeline.session import session_for
from trace_rl.runs.loading import load_config
from trace_rl.storage import RunStorage
from trace_rl.trainer.launcher import stop_all

GONE_WITHIN_S = 15
STEPS = 3


def write_config(tmp_path: Path, name: str) -> Path:
    """The `uninterrupted` run's config (tests/conftest.py) on 2 FSDP workers, a full checkpoint every 2nd step."""
    data = small_config(str(tmp_path / "runs"), name, steps=STEPS, ckpt={"interval": 2})
    data["trainer"].update(num_processes=2, parallel="fsdp")
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(data))
    return path


@pytest.mark.slow
def test_two_gloo_workers_train_as_one_process_and_a_killed_run_takes_them_along_and_resumes_bitwise(
        prefect_api, tmp_path, uninterrupted):
    from flows.train import run_training

    config = load_config(write_config(tmp_path, "two"))
    run_training(config)
    storage = RunStorage(config.storage, config.name)
    expected, weights = load(uninterrupted), load_file(f"{storage.path('weights', f'{STEPS:06d}')}/model.safetensors")
    for name in expected:
        assert (weights[name] - expected[name]).abs().max().item() <= 1e-6, name
    workers = session_for(config).trainer.at(STEPS + 1)
    assert workers.alive and workers.step == STEPS and len(workers.pids) == 2
    pids = list(workers.pids)
    stop_all()  # what the CLI's quiet.stop_engines() does for workers (it would also stop the session's vLLM engine)
    assert not workers.alive and not any(processes.stat(pid) for pid in pids)

    killed_config = write_config(tmp_path, "killed")
    killed = RunStorage(str(tmp_path / "runs"), "killed")
    run = start(killed_config)
    deadline = time.monotonic() + 600
    while not killed.exists(killed.step_path(2, "traces.parquet")):  # inside step 2, before its train stage
        assert run.poll() is None, f"the run ended before the kill point: {output(run)[-3000:]}"
        assert time.monotonic() < deadline, "kill point never reached"
        time.sleep(0.005)
    ranks = start_times([pid for pid in descendants(run.pid)
                         if "trace_rl.trainer.rank" in command(pid) and "torch.distributed.run" not in command(pid)])
    assert len(ranks) == 2, [command(pid) for pid in descendants(run.pid)]
    os.kill(run.pid, signal.SIGKILL)  # the train process alone: its workers must not outlive it
    run.wait()
    gone = time.monotonic()
    while any(is_alive(pid, start) for pid, start in ranks.items()) and time.monotonic() - gone < GONE_WITHIN_S:
        time.sleep(0.1)
    assert not any(is_alive(pid, start) for pid, start in ranks.items())
    assert not killed.is_stable(killed.path("weights", "000002"))

    finish(start(killed_config, "--resume"))  # no checkpoint yet (interval 2): the resume trains from step 1
    assert killed.stable_steps("weights") == [1, 2, 3]  # ckpt.keep_weights_every = 1
    assert (why := weights_difference(killed, storage)) is None, why
