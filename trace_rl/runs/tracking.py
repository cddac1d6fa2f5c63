"""Experiment trackers (`[logging] backends`): the config, per-step and eval metrics of a run in MLflow,
W&B, or a tracker of your own (docs/eval.md).

A backend is `mlflow`, `wandb`, or the name of an entry point in the group `trace_rl.trackers` whose
object is called as `factory(config, storage, run_id)` and returns a `Tracker`. Each backend's run id
is stored with the run (`tracking/<backend>.json`) the first time it opens, so a resumed run logs into
the same tracker run instead of a new one. The config is logged without credentials
(`trace_rl.credentials`), with the run's storage URL.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any, Self

from trace_rl import credentials
from trace_rl.config import Config
from trace_rl.storage import RunStorage

ENTRY_POINT_GROUP = "trace_rl.trackers"
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}  # builtin backend -> the package it needs


class Tracker:
    """One backend's run. Subclasses set `run_id` and implement `log_metrics` and `close`."""

    run_id: str

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError


def public_config(config: Config, storage: RunStorage) -> dict[str, Any]:
    """The config as plain data with every credential-like value left out (at any depth), plus the storage URL."""
    data = credentials.public(credentials.hide(config.model_dump(mode="json")))
    return {**data, "storage_url": storage.url}


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config data as `a.b.c` -> value strings (lists as JSON)."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def step_metrics(metrics: dict[str, Any], reward_mean: float) -> dict[str, float]:
    """A step's numbers for a tracker: every numeric metric, the mean reward and tokens per second."""
    out = {key: float(value) for key, value in metrics.items()
           if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"}
    out["reward_mean"] = reward_mean
    if out.get("time/step") and "batch/tokens" in out:
        out["throughput/tokens_per_s"] = out["batch/tokens"] / out["time/step"]
    return out


class MlflowTracker(Tracker):
    """An MLflow run in the experiment `[logging.mlflow] experiment` (default: the run name)."""

    MAX_METRICS, MAX_PARAMS, MAX_VALUE = 1000, 100, 6000  # MLflow's limits per log_batch and per param value

    def __init__(self, config: Config, storage: RunStorage, run_id: str | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        settings = config.logging.mlflow
        self.client = MlflowClient(tracking_uri=settings.tracking_uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        name = settings.experiment or config.name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=config.name, tags={"trace_rl.storage_url": storage.url})
        self.run_id = run.info.run_id
        params = [Param(key, value[: self.MAX_VALUE]) for key, value in
                  flatten(public_config(config, storage)).items()]
        for start in range(0, len(params), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[start:start + self.MAX_PARAMS])

    @staticmethod
    def metric_key(key: str) -> str:
        """MLflow keys allow letters, digits, `_-. /`: `pass@4` becomes `pass_at_4`."""
        return re.sub(r"[^\w\-. /]", "_", key.replace("@", "_at_"))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(self.metric_key(key), value, now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), self.MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=batch[start:start + self.MAX_METRICS])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class WandbTracker(Tracker):
    """A W&B run in `[logging.wandb] project`; `mode = "offline"` writes it under `dir` to sync later."""

    def __init__(self, config: Config, storage: RunStorage, run_id: str | None):
        import wandb

        settings = config.logging.wandb
        self.run = wandb.init(
            project=settings.project, entity=settings.entity, dir=settings.dir, mode=settings.mode, id=run_id,
            name=config.name, resume="allow" if run_id else None, reinit="create_new",
            config=public_config(config, storage) if run_id is None else None,
        )
        self.run_id = self.run.id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


BUILTIN: dict[str, Callable[[Config, RunStorage, str | None], Tracker]] = {
    "mlflow": MlflowTracker, "wandb": WandbTracker,
}


def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {point.name: point for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def check_trackers(config: Config) -> list[str]:
    """Config-time check of `[logging] backends`: each known, its package installed."""
    problems = []
    plugins = entry_points()
    for index, backend in enumerate(config.logging.backends):
        where = f"logging.backends.{index}"
        if backend in PACKAGES:
            if importlib.util.find_spec(PACKAGES[backend]) is None:
                problems.append(f"{where}: {backend!r} needs the {PACKAGES[backend]} package; "
                                f"pip install 'trace-rl[{backend}]'")
        elif backend not in plugins:
            known = ", ".join([*BUILTIN, *sorted(plugins)])
            problems.append(f"{where}: unknown tracker {backend!r}; use one of: {known} (or register an entry point "
                            f"in the group {ENTRY_POINT_GROUP!r})")
    uri = config.logging.mlflow.tracking_uri
    file_store = "://" not in uri or uri.startswith("file:")
    if "mlflow" in config.logging.backends and file_store and os.environ.get("MLFLOW_ALLOW_FILE_STORE") != "true":
        problems.append(f"logging.mlflow.tracking_uri = {uri!r}: MLflow 3 no longer writes a directory store; use a "
                        "database such as 'sqlite:///mlflow.db' or a server URL (or set MLFLOW_ALLOW_FILE_STORE=true)")
    if len(set(config.logging.backends)) < len(config.logging.backends):
        problems.append("logging.backends: a backend is listed twice; list each once")
    return problems


def state_path(storage: RunStorage, backend: str) -> str:
    return storage.path("tracking", f"{backend}.json")


class Trackers:
    """Every configured tracker of a run, opened with the run ids stored with the run (resume) or new ones."""

    def __init__(self, config: Config, storage: RunStorage):
        self.trackers: list[Tracker] = []
        for backend in config.logging.backends:
            path = state_path(storage, backend)
            run_id = storage.read_json(path)["run_id"] if storage.exists(path) else None
            factory = BUILTIN.get(backend) or entry_points()[backend].load()
            tracker = factory(config, storage, run_id)
            if run_id is None:
                storage.write_json(path, {"backend": backend, "run_id": tracker.run_id})
            self.trackers.append(tracker)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(failed=error is not None)
