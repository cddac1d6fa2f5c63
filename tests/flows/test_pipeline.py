"""The step flow against a real Prefect server: stage order, resume of a failed step, replay."""

from __future__ import annotations

import httpx
import pyarrow.parquet as pq
import pytest

from tests.flows.conftest import small_config
from trace_rl.runs.loading import validate_config
from trace_rl.runs.start import RunExistsError
from trace_rl.storage import RunStorage

STAGES = ["sample_rollouts", "grpo", "validate_dimensions", "aggregate_channels", "write_batch", "train",
          "broadcast_weights"]


def step_runs(api: str, run_name: str) -> list[dict]:
    """The train_step flow runs of a run, oldest first, each with its task runs in start order."""
    flow_runs = httpx.post(f"{api}/flow_runs/filter", json={
        "flow_runs": {"name": {"like_": f"{run_name}-step-"}}, "sort": "START_TIME_ASC"}).json()
    for flow_run in flow_runs:
        tasks = httpx.post(f"{api}/task_runs/filter", json={
            "flow_runs": {"id": {"any_": [flow_run["id"]]}}, "sort": "EXPECTED_START_TIME_ASC"}).json()
        flow_run["tasks"] = [(t["name"], t["state"]["name"]) for t in tasks]
        names = {t["id"]: t["name"] for t in tasks}
        flow_run["waits_for"] = {t["name"]: [names.get(i["id"]) for i in t["task_inputs"].get("wait_for", [])]
                                 for t in tasks}
    return flow_runs


@pytest.fixture(scope="module")
def finished_run(prefect_api, tmp_path_factory):
    from flows.train import run_training

    config = validate_config(small_config(str(tmp_path_factory.mktemp("runs")), "ordered"))
    run_training(config)
    return config


def test_step_flows_run_the_seven_stages_in_order(prefect_api, finished_run):
    runs = step_runs(prefect_api, "ordered")
    assert [r["name"] for r in runs] == ["ordered-step-1", "ordered-step-2"]
    for run in runs:
        assert run["state"]["name"] == "Completed"
        assert [name for name, _ in run["tasks"]] == STAGES
        assert {state for _, state in run["tasks"]} == {"Completed"}
        # the graph in the UI: each stage waits for the one before it, not only for the data it reads
        assert run["waits_for"]["sample_rollouts"] == []
        for index, (earlier, later) in enumerate(zip(STAGES, STAGES[1:])):
            assert earlier in run["waits_for"][later] and set(run["waits_for"][later]) <= set(STAGES[:index + 1])


def test_a_finished_run_has_its_files_and_metrics(finished_run):
    storage = RunStorage(finished_run.storage, finished_run.name)
    assert storage.stable_steps("checkpoints") == [1, 2]
    assert storage.stable_steps("weights") == [1, 2]
    metrics = storage.read_json(storage.step_path(2, "metrics.json"))
    assert metrics["step"] == 2
    assert metrics["batch/samples"] == 8  # 2 examples x 4 rollouts, one branch each
    assert {"rollouts/reverse-text/reward_mean", "channel/grpo/tokens", "train/loss/rl", "time/train"} <= set(metrics)
    assert storage.exists(storage.path("plots", "reward.png"))


def test_a_new_run_refuses_an_existing_directory(finished_run):
    from trace_rl.runs.start import prepare_run

    with pytest.raises(RunExistsError, match="--resume.*--overwrite"):
        prepare_run(finished_run, "new")


def test_failed_train_then_prefect_retry_reuses_the_finished_stages(prefect_api, tmp_path):
    """The train stage fails; `prefect flow-run retry` (a new process) resumes with the earlier stages Cached."""
    import subprocess
    import sys
    from pathlib import Path

    from flows.train import run_training

    config = validate_config(small_config(str(tmp_path), "retried", steps=1))
    storage = RunStorage(config.storage, config.name)
    blocker = storage.path("checkpoints")
    storage.fs.makedirs(storage.root, exist_ok=True)
    storage.fs.pipe(blocker, b"a file where the checkpoint directory must go")  # the train stage cannot write
    with pytest.raises(Exception):
        run_training(config, resume=True)  # the directory exists (it holds the blocker), so resume, not new
    (failed,) = step_runs(prefect_api, "retried")
    assert failed["state"]["name"] == "Failed"
    assert dict(failed["tasks"])["train"] == "Failed"
    train_run = httpx.post(f"{prefect_api}/flow_runs/filter", json={
        "flow_runs": {"name": {"any_": ["retried"]}}}).json()[0]
    assert train_run["state"]["name"] == "Failed"

    storage.fs.rm(blocker)
    root = Path(__file__).resolve().parents[2]
    retry = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", train_run["id"],
                            "--entrypoint", "flows/train.py:train"], cwd=root, capture_output=True, text=True)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]

    assert httpx.get(f"{prefect_api}/flow_runs/{train_run['id']}").json()["state"]["name"] == "Completed"
    tasks = [task for run in step_runs(prefect_api, "retried") for task in run["tasks"]]
    assert tasks[-len(STAGES):] == [(name, "Cached") for name in STAGES[:5]] + [("train", "Completed"),
                                                                                ("broadcast_weights", "Completed")]
    assert storage.stable_steps("weights") == [1]


def test_replay_with_the_runs_own_algorithms_reproduces_its_batches(prefect_api, finished_run, tmp_path):
    from flows.replay import replay
    from trace_rl.algorithms.base import AlgorithmConfig

    source = RunStorage(finished_run.storage, finished_run.name)
    out = f"{tmp_path}/replayed"
    summaries = replay(run=source.url, algorithms=[AlgorithmConfig(id="grpo")], out=out)
    assert [s["step"] for s in summaries] == [1, 2]
    for step in (1, 2):
        original = pq.read_table(source.step_path(step, "batch.parquet"))
        replayed = pq.read_table(RunStorage.from_url(out).step_path(step, "batch.parquet"))
        assert replayed.equals(original)
    assert summaries[0]["replayed"] == summaries[0]["original"]


def test_replay_of_a_run_from_before_numerics_2_keeps_grpos_population_std(prefect_api, finished_run, tmp_path):
    """A run whose config.toml has no `numerics` predates grpo's unbiased std: replaying it keeps the population std;
    the same traces under today's numerics divide by the unbiased std, as TRL and verl do."""
    import numpy as np

    from flows.replay import replay
    from trace_rl.algorithms.base import AlgorithmConfig
    from trace_rl.data.trace import group_traces
    from trace_rl.tables import read_batch, read_traces

    source = RunStorage(finished_run.storage, finished_run.name)
    legacy = RunStorage(str(tmp_path), "legacy")
    source.fs.copy(source.root, legacy.root, recursive=True)
    stored = source.read_bytes(source.path("config.toml")).decode()
    assert "numerics = 2" in stored
    legacy.write_atomic(legacy.path("config.toml"), stored.replace("numerics = 2\n", "").encode())
    grpo_group = [AlgorithmConfig(id="grpo", scale="group")]
    for run, ddof in ((legacy, 0), (source, 1)):
        out = RunStorage(str(tmp_path), f"from-{run.name}-{ddof}")
        replay(run=run.url, algorithms=grpo_group, out=out.url, steps="1:2")
        spread_groups = 0
        for step in (1, 2):
            expected = {}
            for group in group_traces(read_traces(run, step)).values():
                rewards = np.array([t.reward for t in group])
                spread_groups += rewards.std() > 0
                for trace, reward in zip(group, rewards):
                    expected[trace.id] = (reward - rewards.mean()) / (rewards.std(ddof=ddof) + 1e-6)
            samples = read_batch(out, step)
            assert len(samples) == len(expected) == 8
            for sample in samples:
                np.testing.assert_allclose(sample.rl_values[sample.rl_mask], expected[sample.trace_id], rtol=1e-6)
        assert spread_groups > 0, "the test needs a group whose rewards differ"


def test_replay_refuses_a_non_empty_out_unless_overwrite(prefect_api, finished_run, tmp_path):
    from flows.replay import replay
    from trace_rl.algorithms.base import AlgorithmConfig
    from trace_rl.errors import RefusedError

    source = RunStorage(finished_run.storage, finished_run.name).url
    out = f"{tmp_path}/again"
    replay(run=source, algorithms=[AlgorithmConfig(id="grpo")], out=out, steps="1")
    with pytest.raises(RefusedError, match="not empty.*--overwrite"):
        replay(run=source, algorithms=[AlgorithmConfig(id="grpo")], out=out, steps="1")
    summaries = replay(run=source, algorithms=[AlgorithmConfig(id="rl")], out=out, steps="2", overwrite=True)
    assert [s["step"] for s in summaries] == [2]
    assert not RunStorage.from_url(out).exists(RunStorage.from_url(out).step_path(1, "batch.parquet"))


def test_replay_never_writes_over_the_source_run(prefect_api, finished_run):
    from flows.replay import replay
    from trace_rl.algorithms.base import AlgorithmConfig

    source = RunStorage(finished_run.storage, finished_run.name)
    with pytest.raises(ValueError, match="never writes over"):
        replay(run=source.url, algorithms=[AlgorithmConfig(id="rl")], out=source.url)


def test_resume_after_a_death_between_checkpoint_and_weights_exports_them(prefect_api, tmp_path):
    """Killed after checkpoints/<s> became STABLE but before weights/<s>: resume re-enters step s, reuses its
    stages and exports the same weights from the checkpoint (step s+1 must never sample older weights)."""
    from pathlib import Path

    from flows.train import run_training

    config = validate_config(small_config(str(tmp_path), "halfway", steps=2))
    run_training(config)
    storage = RunStorage(config.storage, config.name)
    weights = Path(storage.path("weights", "000002"))
    exported = (weights / "model.safetensors").read_bytes()
    # the state a SIGKILL inside the train task, between the two writes, leaves behind: no weights, and no
    # record of the train task's result (the task never finished)
    storage.remove(str(weights))
    for record in Path(storage.path("prefect", "cache")).glob("halfway-000002-train-*"):
        record.unlink()

    run_training(config, resume=True)
    assert (weights / "model.safetensors").read_bytes() == exported
    resumed = step_runs(prefect_api, "halfway")[-1]
    assert resumed["name"] == "halfway-step-2"
    assert resumed["tasks"] == [(name, "Cached") for name in STAGES[:5]] + [("train", "Completed"),
                                                                             ("broadcast_weights", "Completed")]
