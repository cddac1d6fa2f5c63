"""The remote env server is SIGKILLed while it runs an algorithm for a step: the client retries, the step
fails cleanly before anything of its batch is written, and once the server is back `--resume` finishes the
run with the weights of a run whose server never died."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.bitwise import weights_difference
from tests.conftest import free_port
from tests.faults.conftest import STEPS, write_config
from tests.flows.test_crash_resume import finish, output, start, train_here
from tests.remote.conftest import env_server
from trace_rl.storage import RunStorage

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def remote_run(tmp_path: Path, name: str, port: int, marker: Path) -> tuple[Path, RunStorage]:
    """A run whose only algorithm, slow_once, runs on the env server: its first request sleeps 60 s."""
    env = [{"id": "reverse-text", "batch_size": 2, "group_size": 4, "server": f"http://127.0.0.1:{port}",
            "algorithms": [{"id": "slow_once", "sleep_s": 60.0, "marker": str(marker)}]}]
    config = write_config(tmp_path, name, str(tmp_path / "runs"), env=env,
                          remote={"timeout_s": 120, "max_retries": 2, "retry_backoff_s": 0.5})
    return config, RunStorage(str(tmp_path / "runs"), name)


def test_env_server_killed_mid_call_then_back(prefect_api, tmp_path):
    port = free_port()
    marker = tmp_path / "slept"
    marker.write_text("")  # the uninterrupted run's server answers at once
    straight, straight_storage = remote_run(tmp_path, "env-straight", port, marker)
    with env_server(port=port):
        train_here(straight)
    marker.unlink()

    config, storage = remote_run(tmp_path, "env-killed", port, marker)
    with env_server(port=port):
        process = start(config)
        deadline = time.monotonic() + 300
        while not (marker.exists() and marker.read_text()):  # the server is inside its first call: its pid
            assert process.poll() is None and time.monotonic() < deadline, output(process)[-3000:]
            time.sleep(0.01)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        process.wait(timeout=300)
    err = output(process)
    assert process.returncode != 0
    assert "retry 1/2" in err and "retry 2/2" in err
    assert (f"env server http://127.0.0.1:{port}: algorithm 'slow_once' on group" in err
            and "failed after 3 attempts (remote.max_retries = 2)" in err), err[-3000:]
    assert not storage.exists(storage.step_path(1, "batch.parquet")) and storage.stable_steps("weights") == []

    with env_server(port=port):
        finish(start(config, "--resume"))
    assert storage.stable_steps("weights") == list(range(1, STEPS + 1))  # [ckpt] keep_weights_every = 1
    assert (why := weights_difference(storage, straight_storage)) is None, why
