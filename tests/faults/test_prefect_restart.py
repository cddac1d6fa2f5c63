"""The Prefect server is SIGKILLed during a step and restarted on the same database: the run either
continues or fails cleanly, and `trace-rl train --resume` finishes it with bitwise-identical weights."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from flows import prefect_server
from tests.bitwise import weights_difference
from tests.faults.conftest import write_config
from tests.flows.test_crash_resume import finish, output, start
from trace_rl.storage import RunStorage

pytestmark = [pytest.mark.faults, pytest.mark.slow]

DOWN_S = 3.0


def restart_prefect_server() -> float:
    """SIGKILL the session's Prefect server, wait DOWN_S, start it again on the same port and database;
    the seconds it was unreachable."""
    record = json.loads(prefect_server.state_file().read_text())
    os.killpg(record["pid"], signal.SIGKILL)
    killed = time.monotonic()
    while prefect_server.healthy(record["api_url"]):
        time.sleep(0.05)
    time.sleep(DOWN_S)
    assert prefect_server.start()["api_url"] == record["api_url"]
    return time.monotonic() - killed


def test_prefect_server_restarted_during_a_step(prefect_api, tmp_path, uninterrupted_run):
    name = "prefect-restart"
    config = write_config(tmp_path, name, str(tmp_path / "runs"))
    storage = RunStorage(str(tmp_path / "runs"), name)
    process = start(config)
    deadline = time.monotonic() + 300
    while not storage.exists(storage.step_path(2, "traces.parquet")):  # step 2 is past sampling
        assert process.poll() is None and time.monotonic() < deadline, output(process)[-3000:]
        time.sleep(0.01)
    down_s = restart_prefect_server()
    process.wait(timeout=600)
    if process.returncode:
        err = output(process)
        assert "Traceback" not in err.splitlines()[-1], err[-3000:]  # the last line says what failed
        finish(start(config, "--resume"))
    print(f"Prefect server down {down_s:.1f} s; the run {'failed, resumed' if process.returncode else 'continued'}")
    assert storage.stable_steps("weights") == [1, 2, 3]  # [ckpt] keep_weights_every = 1
    assert (why := weights_difference(storage, uninterrupted_run)) is None, why
