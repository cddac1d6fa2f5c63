"""The step flow against a real Prefect server: stage order, resume of a failed step, replay."""

from __future__ import annotations

import json
import logging
import re
from uuid import UUID

import httpx
import pyarrow.parquet as pq
import pytest

from tests.bitwise import difference
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


def test_the_ui_shows_each_steps_progress_line_and_a_table_of_its_rollouts(prefect_api, finished_run):
    """What a user reads in the UI: the `train` flow run's Logs tab, and the `ordered-rollouts` artifact of each step."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterName,
                                                LogFilter, LogFilterFlowRunId)
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.logging.handlers import APILogWorker, PrefectConsoleHandler

    from flows import quiet
    from trace_rl.pipeline.rollout_table import rollout_rows
    from trace_rl.pipeline.step import algorithm_jobs, channels_path
    from trace_rl.tables import read_channels, read_traces

    APILogWorker.drain_all(timeout=10)  # what the process does on exit: its last log lines to the server
    storage = RunStorage.of(finished_run)
    (grpo,) = algorithm_jobs(finished_run)
    with get_client(sync_client=True) as client:
        (train_run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["ordered"])))
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[train_run.id])))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["ordered-rollouts"])),
                                          sort=ArtifactSort.CREATED_DESC)[::-1]
        pages = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["ordered-episodes"])),
                                      sort=ArtifactSort.CREATED_DESC)[::-1]
    lines = [log.message for log in logs if log.message.startswith("step ")]
    assert len(lines) == 2, [log.message for log in logs]
    for step, line in enumerate(lines, start=1):
        metrics = storage.read_json(storage.step_path(step, "metrics.json"))
        assert re.fullmatch(rf"step {step}/2: reward [0-9.]+, entropy [0-9.]+, {metrics['batch/tokens']} tokens, "
                            r"[0-9.]+ s", line), line
    # printed on the terminal by trace-rl itself: Prefect's console handler skips the line
    record = logging.LogRecord("prefect.flow_runs", logging.INFO, "", 0, lines[0], None, None)
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    assert consoles and all(h.filter(record) for h in consoles)
    record.__dict__.update(quiet.PRINTED)
    assert not any(h.filter(record) for h in consoles)

    steps = step_runs(prefect_api, "ordered")
    assert [a.flow_run_id for a in artifacts] == [UUID(run["id"]) for run in steps]
    # each step links the page of its episodes (`trace-rl view`), written beside the step
    assert [a.flow_run_id for a in pages] == [UUID(run["id"]) for run in steps]
    for step, page in enumerate(pages, start=1):
        assert page.type == "markdown" and f"(file://{storage.step_path(step, 'episodes.html')})" in page.data
        assert storage.read_bytes(storage.step_path(step, "episodes.html")).decode().count("<section") == 8
    for step, artifact in enumerate(artifacts, start=1):
        cells = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
        # the UI renders cells as Markdown: their punctuation comes backslash-escaped, so that it shows as written
        assert all(row["prompt"].startswith("reverse\\: ") for row in cells)
        rows = [{k: re.sub(r"\\(.)", r"\1", v) if isinstance(v, str) else v for k, v in row.items()} for row in cells]
        traces = read_traces(storage, step)
        channels = read_channels(storage, channels_path(storage, step, grpo, "parquet"))
        assert rows == rollout_rows(finished_run, step, traces, channels)
        # 2 groups of 4: from each its best, its worst and one other; grpo's advantage r - mean of the group
        assert len(rows) == 6 and {row["env"] for row in rows} == {"reverse-text"}
        assert {row["policy_step"] for row in rows} == {step - 1}
        means = {t.example_id: sum(u.reward for u in traces if u.group_id == t.group_id) / 4 for t in traces}
        for row in rows:
            assert row["advantage"] == pytest.approx(row["reward"] - means[row["example"]], abs=2e-4)
            assert row["prompt"].startswith("reverse: ") and isinstance(row["completion"], str)


def test_the_progress_line_names_reused_stages_failed_traces_and_retries():
    from flows.train import step_line

    metrics = {"step": 4, "time/step": 2.25, "train/entropy": 1.5, "batch/tokens": 96, "rollouts/retries": 0.0,
               "rollouts/a/reward_mean": 0.5, "rollouts/a/traces": 8.0, "rollouts/a/errors": 0.0,
               "rollouts/b/reward_mean": 0.25, "rollouts/b/traces": 8.0, "rollouts/b/errors": 0.0}
    config = validate_config(small_config("runs", "line", steps=5))
    assert step_line(config, metrics, "") == "step 4/5: reward 0.375, entropy 1.500, 96 tokens, 2.2 s"
    metrics.update({"rollouts/a/errors": 1.0, "rollouts/b/errors": 2.0, "rollouts/retries": 4.0})
    assert step_line(config, metrics, "train") == ("step 4/5: reward 0.375, entropy 1.500, 96 tokens, 2.2 s (reused "
                                                   "train); warning: 3 of 16 traces failed, 4 retries")


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
                            "--entrypoint", "flows/train.py:train_flow"], cwd=root, capture_output=True, text=True)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]

    assert httpx.get(f"{prefect_api}/flow_runs/{train_run['id']}").json()["state"]["name"] == "Completed"
    tasks = [task for run in step_runs(prefect_api, "retried") for task in run["tasks"]]
    assert tasks[-len(STAGES):] == [(name, "Cached") for name in STAGES[:5]] + [("train", "Completed"),
                                                                                ("broadcast_weights", "Completed")]
    assert storage.stable_steps("weights") == [1]


def test_replay_with_the_runs_own_algorithms_reproduces_its_batches(prefect_api, finished_run, tmp_path):
    from flows.replay import replay_flow
    from trace_rl.algorithms.base import AlgorithmConfig

    source = RunStorage(finished_run.storage, finished_run.name)
    out = f"{tmp_path}/replayed"
    summaries = replay_flow(run=source.url, algorithms=[AlgorithmConfig(id="grpo")], out=out)
    assert [s["step"] for s in summaries] == [1, 2]
    for step in (1, 2):
        original = pq.read_table(source.step_path(step, "batch.parquet"))
        replayed = pq.read_table(RunStorage.from_url(out).step_path(step, "batch.parquet"))
        assert replayed.equals(original)
    assert summaries[0]["replayed"] == summaries[0]["original"]


def test_replay_refuses_a_non_empty_out_unless_overwrite(prefect_api, finished_run, tmp_path):
    from flows.replay import replay_flow
    from trace_rl.algorithms.base import AlgorithmConfig
    from trace_rl.errors import RefusedError

    source = RunStorage(finished_run.storage, finished_run.name).url
    out = f"{tmp_path}/again"
    replay_flow(run=source, algorithms=[AlgorithmConfig(id="grpo")], out=out, steps="1")
    with pytest.raises(RefusedError, match="not empty.*--overwrite"):
        replay_flow(run=source, algorithms=[AlgorithmConfig(id="grpo")], out=out, steps="1")
    summaries = replay_flow(run=source, algorithms=[AlgorithmConfig(id="rl")], out=out, steps="2", overwrite=True)
    assert [s["step"] for s in summaries] == [2]
    assert not RunStorage.from_url(out).exists(RunStorage.from_url(out).step_path(1, "batch.parquet"))


def test_replay_never_writes_over_the_source_run(prefect_api, finished_run):
    from flows.replay import replay_flow
    from trace_rl.algorithms.base import AlgorithmConfig

    source = RunStorage(finished_run.storage, finished_run.name)
    with pytest.raises(ValueError, match="never writes over"):
        replay_flow(run=source.url, algorithms=[AlgorithmConfig(id="rl")], out=source.url)


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
    assert (why := difference((weights / "model.safetensors").read_bytes(), exported)) is None, why
    resumed = step_runs(prefect_api, "halfway")[-1]
    assert resumed["name"] == "halfway-step-2"
    assert resumed["tasks"] == [(name, "Cached") for name in STAGES[:5]] + [("train", "Completed"),
                                                                             ("broadcast_weights", "Completed")]
