"""Experiment tracking: a real `mlflow server` on loopback receives a run's config, step and eval metrics, and a
resumed run continues the same MLflow run; W&B in offline mode; the config logged without credentials."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.flows.conftest import small_config
from trace_rl.runs.loading import validate_config
from trace_rl.runs.tracking import Trackers, flatten, public_config, state_path
from trace_rl.storage import RunStorage

MLFLOW_START_S = 180  # the server creates its database and starts uvicorn: ~30 s on a busy 2-core machine


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    with open(root / "server.log", "w") as log:  # the server writes to its own copy of the descriptor
        proc = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--default-artifact-root", str(root / "artifacts")],
            stdout=subprocess.DEVNULL, stderr=log, process_group=0,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + MLFLOW_START_S
        while True:
            assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker: the group this fixture started
        proc.wait(30)


def test_mlflow_server_gets_a_2_step_run_and_resume_continues_the_same_run(prefect_api, mlflow_server, tmp_path):
    from mlflow import MlflowClient

    from flows.train import run_training

    logging = {"backends": ["mlflow"], "mlflow": {"tracking_uri": mlflow_server, "experiment": "tracked"}}
    evaluation = {"k": 2, "num_examples": 2, "envs": [{"id": "reverse-text"}]}
    data = small_config(str(tmp_path / "runs"), "tracked", steps=2, logging=logging, eval=evaluation)
    run_training(validate_config(data))

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("tracked")
    [run] = client.search_runs([experiment.experiment_id])
    storage = RunStorage(str(tmp_path / "runs"), "tracked")
    assert storage.read_json(state_path(storage, "mlflow")) == {"backend": "mlflow", "run_id": run.info.run_id}
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["trainer.lr"] == "0.001" and run.data.params["storage_url"] == storage.url
    assert run.data.tags["trace_rl.storage_url"] == storage.url
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [m.step for m in history] == [1, 2]
    for key in ("train/loss/rl", "train/grad_norm", "time/step", "throughput/tokens_per_s", "batch/tokens"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/reverse-text/pass_at_1")] == [2]
    metrics = json.loads(Path(storage.step_path(2, "metrics.json")).read_text())
    assert history[1].value == pytest.approx(metrics["rollouts/reverse-text/reward_mean"])

    run_training(validate_config({**data, "steps": 3}), resume=True)
    [again] = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/reverse-text/pass_at_1")] == [2, 3]


def test_mlflow_defaults_to_a_local_database_and_refuses_a_directory_store(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from trace_rl.config import ConfigError

    monkeypatch.chdir(tmp_path)
    config = validate_config(small_config(str(tmp_path / "runs"), "local", logging={"backends": ["mlflow"]}))
    storage = RunStorage(config.storage, config.name)
    with Trackers(config, storage) as trackers:
        trackers.log_metrics({"reward_mean": 0.5, "eval/reverse-text/pass@2": 1.0}, step=1)
    client = MlflowClient(tracking_uri="sqlite:///mlflow.db")  # in the working directory
    [run] = client.search_runs([client.get_experiment_by_name("local").experiment_id])
    assert run.data.metrics == {"reward_mean": 0.5, "eval/reverse-text/pass_at_2": 1.0}
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    directory = {"backends": ["mlflow"], "mlflow": {"tracking_uri": "./mlruns"}}
    with pytest.raises(ConfigError, match="tracking_uri = './mlruns': MLflow 3 no longer writes a directory store"):
        validate_config(small_config(str(tmp_path / "runs"), "dir", logging=directory))


def test_wandb_offline_run_and_resume_with_the_same_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    logging = {"backends": ["wandb"], "wandb": {"mode": "offline", "dir": str(tmp_path), "project": "p"}}
    config = validate_config(small_config(str(tmp_path / "runs"), "offline", logging=logging))
    storage = RunStorage(config.storage, config.name)
    with Trackers(config, storage) as trackers:
        trackers.log_metrics({"reward_mean": 0.25}, step=1)
    run_id = storage.read_json(state_path(storage, "wandb"))["run_id"]
    with Trackers(config, storage) as trackers:
        trackers.log_metrics({"reward_mean": 0.5}, step=2)
    runs = sorted(glob.glob(f"{tmp_path}/wandb/offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs)  # the resumed run has the same id
    # the offline record files (protobuf records, synced later by `wandb sync`) hold the history and the config;
    # wandb's service process writes them: under load a file was seen holding only its header as `finish` returned
    records = [Path(r, f"run-{run_id}.wandb") for r in runs]
    deadline = time.monotonic() + 30
    while not all(b"reward_mean" in path.read_bytes() for path in records) and time.monotonic() < deadline:
        time.sleep(0.1)
    first, second = (path.read_bytes() for path in records)
    assert b"reward_mean" in first and b"0.25" in first and b"micro_batch_tokens" in first
    assert b"reward_mean" in second and b"0.5" in second and b"micro_batch_tokens" not in second


def test_the_logged_config_has_no_credentials(tmp_path):
    data = small_config(str(tmp_path / "runs"), "secret")
    data["storage_options"] = {"key": "AKIA-VISIBLE-NOT", "secret": "s3cr3t-value", "client_kwargs": {
        "aws_secret_access_key": "another-s3cr3t", "region_name": "eu-west-1"}}
    config = validate_config(data)
    storage = RunStorage(str(tmp_path / "runs"), "secret")
    params = flatten(public_config(config, storage))
    text = json.dumps(params)
    assert "s3cr3t" not in text and "AKIA" not in text
    assert params["storage_options.client_kwargs.region_name"] == "eu-west-1"
    assert params["trainer.lr"] == "0.001" and params["storage_url"] == storage.url


def test_unknown_or_missing_tracker_is_a_config_error(tmp_path):
    from trace_rl.config import ConfigError

    data = small_config(str(tmp_path / "runs"), "bad", logging={"backends": ["neptune", "mlflow", "mlflow"]})
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    assert "logging.backends.0: unknown tracker 'neptune'; use one of: mlflow, wandb" in str(caught.value)
    assert "a backend is listed twice" in str(caught.value)
