"""SIGKILL a real `trace-rl train` process at several points; resuming ends with bitwise-identical weights. A run with
partial rollouts killed at every stage of a step: tests/flows/test_partial_runs.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from tests.bitwise import weights_difference
from tests.flows.conftest import small_config
from trace_rl.storage import RunStorage

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def write_config(tmp_path: Path, name: str, **overrides) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(small_config(str(tmp_path / "runs"), name, steps=STEPS, **overrides)))
    return path


def start(config: Path, *flags: str, kill_at: tuple[str, int] | None = None) -> subprocess.Popen:
    """The run, its stderr in a file beside the config (vLLM logs more than a pipe holds unread); with `kill_at`
    (point, step) it SIGKILLs itself there (tests/flows/kill_at.py)."""
    log = open(config.with_suffix(f".{time.monotonic_ns()}.log"), "w+")  # noqa: SIM115 - read by output()
    cli = ["flows.cli"] if kill_at is None else ["tests.flows.kill_at", kill_at[0], str(kill_at[1])]
    process = subprocess.Popen([sys.executable, "-m", *cli, "train", str(config), *flags], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=log, text=True, process_group=0)
    process.log = log
    return process


def output(process: subprocess.Popen) -> str:
    process.log.seek(0)
    return process.log.read()


def finish(process: subprocess.Popen) -> None:
    process.wait(timeout=600)
    assert process.returncode == 0, output(process)[-3000:]


def train_here(config: Path) -> None:
    """The uninterrupted run a killed one is compared with, trained in this process: the same flow as
    `trace-rl train CONFIG` without a process of its own to start."""
    from flows.train import run_training
    from trace_rl.runs.loading import load_config

    run_training(load_config(config))


def kill_when(process: subprocess.Popen, ready, timeout: float = 300) -> None:
    """SIGKILL the process (and its children) as soon as `ready()` holds."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, f"the run ended before the kill point: {output(process)[-3000:]}"
        assert time.monotonic() < deadline, "kill point never reached"
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.slow
def test_killed_and_resumed_run_ends_bitwise_identical(prefect_api, tmp_path, uninterrupted_run):
    config = write_config(tmp_path, "killed")
    storage = RunStorage(str(tmp_path / "runs"), "killed")
    step_file = lambda step, name: lambda: storage.exists(storage.step_path(step, name))  # noqa: E731
    # the upload takes milliseconds: this kill lands inside it or just after STABLE, both real crash points
    checkpoint_writing = lambda: storage.exists(storage.path("checkpoints", "000002"))  # noqa: E731
    kill_points = [
        ("after sampling step 1", step_file(1, "traces.parquet")),
        ("after writing the batch of step 1", step_file(1, "batch.parquet")),
        ("during the checkpoint write of step 2", checkpoint_writing),
        ("after the weights of step 2", lambda: storage.is_stable(storage.path("weights", "000002"))),
    ]
    flags: tuple[str, ...] = ()
    for _, ready in kill_points:
        kill_when(start(config, *flags), ready)
        flags = ("--resume",)
    finish(start(config, "--resume"))
    assert storage.stable_steps("weights") == [1, 2, 3]  # ckpt.keep_weights_every = 1
    assert (why := weights_difference(storage, uninterrupted_run)) is None, why
