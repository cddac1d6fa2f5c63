"""SIGKILL a real `trace-rl train` process at several points; resuming ends with bitwise-identical weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import tomli_w

from tests.flows.conftest import small_config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_traces

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def write_config(tmp_path: Path, name: str, **overrides) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(small_config(str(tmp_path / "runs"), name, steps=STEPS, **overrides)))
    return path


def start(config: Path, *flags: str) -> subprocess.Popen:
    """The run, its stderr in a file beside the config (vLLM logs more than a pipe holds unread)."""
    log = open(config.with_suffix(f".{time.monotonic_ns()}.log"), "w+")  # noqa: SIM115 - read by output()
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", str(config), *flags], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=log, text=True, start_new_session=True)
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


def weights(tmp_path: Path, name: str, step: int = STEPS) -> bytes:
    storage = RunStorage(str(tmp_path / "runs"), name)
    return (Path(storage.path("weights", f"{step:06d}")) / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_killed_and_resumed_run_ends_bitwise_identical(prefect_api, tmp_path):
    train_here(write_config(tmp_path, "straight"))
    expected = weights(tmp_path, "straight")

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
    assert weights(tmp_path, "killed") == expected


@pytest.mark.slow
def test_async_run_with_partial_rollouts_killed_while_sampling_ahead_and_while_training_resumes_bitwise_identical(
        prefect_api, tmp_path):
    """k = 1 with partial rollouts (segments of 3 tokens, several stop tokens so rollouts end at different lengths):
    step 3 is sampled while step 2 trains, continuing the rollouts step 2 left in flight; kills land in that
    sampling, in step 2's checkpoint write, and after step 3's traces are saved but before they are trained on (the
    resumed run reuses them)."""
    one_ahead = {"async": {"max_off_policy_steps": 1, "partial_rollout_tokens": 3},
                 "model": {"name": "tiny", "stop_tokens": ["<|im_end|>", *"etaoinshr"]},
                 "sampling": {"max_completion_tokens": 9}}
    train_here(write_config(tmp_path, "async-straight", **one_ahead))
    expected = weights(tmp_path, "async-straight")
    straight = RunStorage(str(tmp_path / "runs"), "async-straight")
    continued = [t for step in (1, 2, 3) for t in read_traces(straight, step)
                 if len(set(t.branches[0].policy_versions[t.branches[0].sampled].tolist())) > 1]
    assert continued, "no rollout was continued under newer weights"
    assert straight.exists(straight.step_path(3, "in_flight.json"))
    from flows.replay import replay_flow
    from trace_rl.algorithms.base import AlgorithmConfig

    replay_flow(run=straight.url, algorithms=[AlgorithmConfig(id="grpo")], out=f"{tmp_path}/replayed")
    for step in range(1, STEPS + 1):  # the replay of a run with partial rollouts reproduces its batches
        assert pq.read_table(RunStorage.from_url(f"{tmp_path}/replayed").step_path(step, "batch.parquet")).equals(
            pq.read_table(straight.step_path(step, "batch.parquet")))

    config = write_config(tmp_path, "async-killed", **one_ahead)
    storage = RunStorage(str(tmp_path / "runs"), "async-killed")
    traces_3 = Path(storage.step_path(3, "traces.parquet"))

    def sampled_3_recorded() -> bool:  # the stage's cache record: what a resumed run reuses it by
        cache = Path(storage.path("prefect", "cache"))
        return cache.exists() and any("000003-sample_rollouts" in p.name for p in cache.iterdir())

    kill_points = [
        ("sampling step 3 while step 2 trains",
         lambda: storage.exists(storage.step_path(2, "batch.parquet")) and not traces_3.exists()),
        ("during the checkpoint write of step 2", lambda: storage.exists(storage.path("checkpoints", "000002"))),
        ("step 3 sampled, not trained", lambda: sampled_3_recorded() and not storage.exists(
            storage.path("checkpoints", "000003"))),
    ]
    flags: tuple[str, ...] = ()
    for _, ready in kill_points:
        kill_when(start(config, *flags), ready)
        flags = ("--resume",)
    sampled = traces_3.stat()
    finish(start(config, "--resume"))
    assert (traces_3.stat().st_ino, traces_3.stat().st_mtime_ns) == (sampled.st_ino, sampled.st_mtime_ns)
    assert storage.stable_steps("weights") == [1, 2, 3]
    assert weights(tmp_path, "async-killed") == expected
