"""`train_step`: one training step as a Prefect flow, its stages as tasks in a fixed order."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.cache_policies import NO_CACHE

from tasks.aggregate_channels import aggregate_channels
from tasks.broadcast_weights import broadcast_weights
from tasks.run_algorithm import run_algorithm
from tasks.sample_rollouts import sample_rollouts
from tasks.train import train
from tasks.validate_dimensions import validate_dimensions
from tasks.write_batch import write_batch
from tasks.caching import stage_options
from trace_rl import step as stages
from trace_rl.config import Config
from trace_rl.session import session_for


@flow(name="train_step", flow_run_name="{config.name}-step-{step}", log_prints=True)
def train_step(config: Config, step: int) -> dict:
    logger = get_run_logger()
    resumable = stage_options(config)
    timings: dict[str, float] = {}
    reused: list[str] = []

    def run(task, label: str, options: dict = resumable, **kwargs):
        started = time.perf_counter()
        state = task.with_options(**options)(config=config, step=step, return_state=True, **kwargs)
        timings[label] = time.perf_counter() - started
        if state.name == "Cached" or (state.name == "Completed" and state.result().get("reused_checkpoint")):
            reused.append(label)
        return state.result()  # raises the stage's error if it failed

    rollouts = run(sample_rollouts, "sample_rollouts")
    jobs = stages.algorithm_jobs(config)
    algorithms = [run(run_algorithm, f"algorithm/{job.config.id}", job=job) for job in jobs]
    paths = [result["channels"] for result in algorithms]
    run(validate_dimensions, "validate_dimensions", channel_paths=paths)
    aggregated = run(aggregate_channels, "aggregate_channels", channel_paths=paths)
    batch = run(write_batch, "write_batch", channel_paths=paths)
    # never from Prefect's cache: with ckpt.interval > 1 a resume re-trains steps whose train task once finished
    # (the trainer's state is the newest checkpoint's); `train` itself reuses a step's checkpoint when it exists
    trained = run(train, "train", options={**resumable, "cache_policy": NO_CACHE},
                  algorithm_states=stages.algorithm_state_paths(session_for(config), step, jobs))
    started = time.perf_counter()
    broadcast_weights(config=config, step=step)
    timings["broadcast_weights"] = time.perf_counter() - started
    if reused:
        logger.info("step %d: reused the finished stages %s", step, ", ".join(reused))

    metrics = step_metrics(step, rollouts, algorithms, aggregated, trained, timings)
    stages.write_metrics(session_for(config), step, metrics)
    return {"step": step, "batch": batch["batch"], "weights": trained["weights"], "reused": reused, "metrics": metrics}


def step_metrics(step: int, rollouts: dict, algorithms: list[dict], aggregated: dict, trained: dict,
                 timings: dict[str, float]) -> dict:
    metrics: dict = {"step": step, **rollouts["metrics"]}
    for result in algorithms:
        metrics.update(result["stats"])
    metrics.update({f"batch/{k}": v for k, v in aggregated.items()})
    metrics.update({f"train/{k}": v for k, v in trained["metrics"].items()})
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    return metrics
