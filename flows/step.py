"""`train_step`: one training step as a Prefect flow, its stages as tasks in a fixed order.

With `[async] max_off_policy_steps = k >= 1` the step also samples the steps after it (up to step + k,
trace_rl.pipeline.schedule) as submitted `sample_rollouts-step-<m>` task runs that run beside its `train` task,
and returns their results: the next `train_step` starts from them instead of sampling.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.cache_policies import NO_CACHE

from flows.artifacts import publish_rollouts
from flows.caching import stage_options
from flows.tasks import (aggregate_channels_task, broadcast_weights_task, run_algorithm_task, sample_rollouts_task,
                         train_policy_task, validate_dimensions_task, write_batch_task)
from trace_rl.config import Config
from trace_rl.pipeline import step as stages
from trace_rl.storage import RunStorage


@flow(name="train_step", flow_run_name="{config.name}-step-{step}", log_prints=True)
def step_flow(config: Config, step: int, rollouts: dict | None = None, sample_ahead: list[int] | None = None) -> dict:
    """`rollouts`: this step's `sample_rollouts` result when an earlier step sampled it; `sample_ahead`: the later
    steps to sample while this one trains."""
    logger = get_run_logger()
    storage = RunStorage.of(config)
    resumable = stage_options(storage)
    timings: dict[str, float] = {}
    reused: list[str] = []

    # the stages that ran before the next one: its `wait_for`, so the UI's graph shows the fixed order of the stages,
    # not only the edges of the data they pass
    before: list = []

    def run(task, label: str, options: dict = resumable, **kwargs):
        started = time.perf_counter()
        state = task.with_options(**options)(config=config, step=step, return_state=True, wait_for=list(before),
                                             **kwargs)
        timings[label] = time.perf_counter() - started
        if state.name == "Cached" or (state.name == "Completed" and state.result().get("reused_checkpoint")):
            reused.append(label)
        return state, state.result()  # raises the stage's error if it failed

    def stage(task, label: str, options: dict = resumable, **kwargs):
        state, result = run(task, label, options, **kwargs)
        before[:] = [state]
        return result

    if rollouts is None:
        rollouts = stage(sample_rollouts_task, "sample_rollouts")
    else:
        timings["sample_rollouts"] = rollouts["seconds"]
    jobs = stages.algorithm_jobs(config)
    ran = [run(run_algorithm_task, f"algorithm/{job.config.id}", job=job) for job in jobs]  # each after sampling
    before[:] = [state for state, _ in ran]
    algorithms = [result for _, result in ran]
    paths = [result["channels"] for result in algorithms]
    stage(validate_dimensions_task, "validate_dimensions", channel_paths=paths)
    aggregated = stage(aggregate_channels_task, "aggregate_channels", channel_paths=paths)
    batch = stage(write_batch_task, "write_batch", aggregated=aggregated["aggregated"])
    publish_rollouts(config, step, aggregated["rollouts"])
    ahead = []
    for later in sample_ahead or []:  # one after the other: each loads its own weights into the one sampler
        ahead.append(sample_rollouts_task.with_options(**resumable, task_run_name=f"sample_rollouts-step-{later}").submit(
            config=config, step=later, wait_for=ahead[-1:]))
    # never from Prefect's cache: with ckpt.interval > 1 a resume re-trains steps whose train task once finished
    # (the trainer's state is the newest checkpoint's); `train` itself reuses a step's checkpoint when it exists
    trained = stage(train_policy_task, "train", options={**resumable, "cache_policy": NO_CACHE},
                    algorithm_states=stages.algorithm_state_paths(storage, step, jobs))
    sampled = []
    if config.async_.max_off_policy_steps == 0:
        stage(broadcast_weights_task, "broadcast_weights", options={})
    elif ahead:  # each sampling loads its own scheduled weights: nothing to broadcast
        started = time.perf_counter()
        sampled = [future.result() for future in ahead]
        timings["wait_for_sampling"] = time.perf_counter() - started
        reused += [f"sample_rollouts-step-{later}" for later, future in zip(sample_ahead, ahead)
                   if future.state.name == "Cached"]
    if reused:
        logger.info("step %d: reused the finished stages %s", step, ", ".join(reused))

    metrics = step_metrics(step, rollouts, algorithms, aggregated, trained, timings)
    stages.write_metrics(storage, step, metrics)
    return {"step": step, "batch": batch["batch"], "weights": trained["weights"], "reused": reused, "metrics": metrics,
            "sampled": sampled}  # the results of `sample_ahead`, in its order


def step_metrics(step: int, rollouts: dict, algorithms: list[dict], aggregated: dict, trained: dict,
                 timings: dict[str, float]) -> dict:
    metrics: dict = {"step": step, **rollouts["metrics"]}
    for result in algorithms:
        metrics.update(result["stats"])
    metrics.update({f"batch/{k}": v for k, v in aggregated["stats"].items()})
    metrics.update({f"train/{k}": v for k, v in trained["metrics"].items()})
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    return metrics
