"""`[async] max_off_policy_steps`: the schedule on every trace, sampling beside training in Prefect, replay."""

from __future__ import annotations

from datetime import datetime

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.flows.conftest import small_config
from trace_rl.pipeline.schedule import sampling_weights
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_batch, read_traces

STEPS = 4


def run_async(storage: str, name: str, k: int):
    from flows.train import run_training

    # every step's weights kept (ckpt.keep = STEPS): the replay test below scores with each step's sampling weights
    config = validate_config(small_config(storage, name, steps=STEPS, ckpt={"keep": STEPS},
                                          **{"async": {"max_off_policy_steps": k}}))
    run_training(config)
    return config


@pytest.fixture(scope="module", params=[1, 2], ids=["k1", "k2"])
def async_run(request, prefect_api, tmp_path_factory):
    return request.param, run_async(str(tmp_path_factory.mktemp("runs")), f"async-k{request.param}", request.param)


def task_runs(api: str, flow_run_name: str) -> dict[str, dict]:
    flow_run, = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [flow_run_name]}}}).json()
    tasks = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}}).json()
    return {t["name"]: t for t in tasks}


def interval(task: dict) -> tuple[datetime, datetime]:
    return datetime.fromisoformat(task["start_time"]), datetime.fromisoformat(task["end_time"])


def test_every_trace_was_sampled_with_the_scheduled_weights(async_run):
    k, config = async_run
    storage = RunStorage(config.storage, config.name)
    for step in range(1, STEPS + 1):
        traces = read_traces(storage, step)
        assert {t.policy_step for t in traces} == {sampling_weights(step, k)}, step
        assert all(t.policy_step >= step - 1 - k for t in traces)  # never more than k versions behind
        metrics = storage.read_json(storage.step_path(step, "metrics.json"))
        assert metrics["async/policy_lag_max"] == step - 1 - sampling_weights(step, k)
        # every sampled token records the scheduled weights; without partial rollouts none is stale or masked
        assert {int(v) for t in traces for b in t.branches for v in b.policy_versions[b.sampled]} == {
            sampling_weights(step, k)}
        assert (metrics["async/token_age_max"], metrics["batch/age_masked_tokens"]) == (step - 1 - sampling_weights(
            step, k), 0)
        assert {int(v) for s in read_batch(storage, step) for v in s.policy_versions[s.sampled]} == {
            sampling_weights(step, k)}
        assert {"train/mismatch/k3_kl", "train/mismatch/mean_abs_logprob_diff", "train/mismatch/is_capped_fraction",
                "time/sample_rollouts", "time/train"} <= set(metrics)
    assert storage.stable_steps("weights") == list(range(1, STEPS + 1))


def test_later_steps_are_sampled_as_their_own_task_runs_beside_training(prefect_api, async_run):
    k, config = async_run
    for step in range(1, STEPS + 1):
        tasks = task_runs(prefect_api, f"{config.name}-step-{step}")
        assert "broadcast_weights" not in tasks
        assert ("sample_rollouts" in tasks) == (step == 1)  # later steps start from what an earlier one sampled
        expected = range(2, 2 + k) if step == 1 else [step + k] if step + k <= STEPS else []
        assert sorted(name for name in tasks if "-step-" in name) == [f"sample_rollouts-step-{m}" for m in expected]
        training = tasks["train"]
        assert all(tasks[f"sample_rollouts-step-{m}"]["state"]["name"] == "Completed" for m in expected)
        assert training["state"]["name"] == "Completed"
        if expected:  # the first sampling starts beside `train` (the next ones follow it: one sampler)
            (sample_start, sample_end), (train_start, train_end) = (
                interval(tasks[f"sample_rollouts-step-{expected[0]}"]), interval(training))
            assert sample_start < train_end and train_start < sample_end, f"step {step}: not concurrent"
    metrics = RunStorage(config.storage, config.name).read_json(
        RunStorage(config.storage, config.name).step_path(2, "metrics.json"))
    assert metrics["time/wait_for_sampling"] >= 0


def test_replay_of_an_async_run_reproduces_its_batches(prefect_api, async_run, tmp_path):
    from flows.replay import replay_flow
    from trace_rl.algorithms.base import AlgorithmConfig

    _, config = async_run
    source = RunStorage(config.storage, config.name)
    replay_flow(run=source.url, algorithms=[AlgorithmConfig(id="grpo")], out=f"{tmp_path}/replayed")
    for step in range(1, STEPS + 1):
        original = pq.read_table(source.step_path(step, "batch.parquet"))
        assert pq.read_table(RunStorage.from_url(f"{tmp_path}/replayed").step_path(step, "batch.parquet")).equals(
            original)


def test_k0_trains_the_same_weights_as_the_synchronous_library_loop(prefect_api, tmp_path):
    """The flow with `[async] max_off_policy_steps = 0` against `run_step` of a config without an `[async]` table,
    step by step: bitwise the same batches and weights.

    It also pins that without `partial_rollout_tokens` the pipeline is the one before partial rollouts existed: no
    partial code runs (no in-flight store, no partial/* metrics), every sampled token records its trace's
    policy_step (-1 elsewhere), so no token is stale and nothing is masked."""
    from flows.train import run_training
    from trace_rl.pipeline.session import Session
    from trace_rl.pipeline.step import run_step

    flowed = validate_config(small_config(str(tmp_path), "k0-flow", steps=3, **{"async": {"max_off_policy_steps": 0}}))
    run_training(flowed)
    looped = validate_config(small_config(str(tmp_path), "k0-loop", steps=3))
    session = Session(looped)
    for step in (1, 2, 3):
        run_step(session, step)
    flow_storage, loop_storage = RunStorage(str(tmp_path), "k0-flow"), session.storage
    for step in (1, 2, 3):
        assert {t.policy_step for t in read_traces(flow_storage, step)} == {step - 1}
        batches = [pq.read_table(s.step_path(step, "batch.parquet")) for s in (flow_storage, loop_storage)]
        assert batches[0].equals(batches[1])
        for sample in read_batch(flow_storage, step):
            assert np.array_equal(sample.policy_versions, np.where(sample.sampled, step - 1, -1))
        metrics = flow_storage.read_json(flow_storage.step_path(step, "metrics.json"))
        assert metrics["batch/age_masked_tokens"] == 0 and not any(key.startswith("partial/") for key in metrics)
        assert not any(s.exists(s.step_path(step, "in_flight.json")) for s in (flow_storage, loop_storage))
    weights = [s.read_bytes(s.path("weights", "000003", "model.safetensors")) for s in (flow_storage, loop_storage)]
    assert weights[0] == weights[1]


def test_the_metrics_artifact_shows_sample_train_and_wait_times(prefect_api, async_run):
    import json

    from flows.artifacts import artifact_key

    k, config = async_run
    latest, = httpx.post(f"{prefect_api}/artifacts/filter", json={
        "artifacts": {"key": {"any_": [artifact_key(config, "metrics")]}}, "sort": "CREATED_DESC", "limit": 1}).json()
    table = latest["data"] if isinstance(latest["data"], list) else json.loads(latest["data"])
    assert [row["step"] for row in table] == list(range(1, STEPS + 1))
    for row in table:
        assert {"time/sample_rollouts", "time/train", "async/policy_lag_max", "async/token_age_max"} <= set(row)
        # a step waits for the sampling beside it; the last k steps sample nothing beside their training
        assert ("time/wait_for_sampling" in row) == (row["step"] + k <= STEPS or row["step"] == 1 and k < STEPS)


@pytest.mark.slow
def test_the_async_demo_config_learns_on_cpu(tmp_path):
    """configs/async.toml (k = 1) on the hf sampler for 10 of its steps: the reward rises. The library loop samples
    each step with the same scheduled weights as the flow, so it learns the same."""
    from pathlib import Path

    from trace_rl.pipeline.session import Session
    from trace_rl.pipeline.step import run_step
    from trace_rl.runs.loading import load_config

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "async.toml",
                         [f"storage={tmp_path}", "inference.backend=hf", "steps=10"])
    assert config.async_.max_off_policy_steps == 1
    session = Session(config)
    rewards = [run_step(session, step)["rollouts"]["metrics"]["rollouts/reverse-text/reward_mean"]
               for step in range(1, 11)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards
