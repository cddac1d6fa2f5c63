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
    run = StageOrder(config, step)
    jobs = stages.algorithm_jobs(config)
    states = stages.algorithm_state_paths(run.storage, step, jobs)  # where each algorithm keeps its state

    rollouts = run.given(rollouts, "sample_rollouts") or run.stage(sample_rollouts_task, "sample_rollouts")
    algorithms = run.fan_out(run_algorithm_task, {f"algorithm/{job.config.id}": {"job": job} for job in jobs})
    run.stage(validate_dimensions_task, "validate_dimensions", channel_paths=channel_paths(algorithms))
    aggregated = run.stage(aggregate_channels_task, "aggregate_channels", channel_paths=channel_paths(algorithms))
    batch = run.stage(write_batch_task, "write_batch", aggregated=aggregated["aggregated"])
    publish_rollouts(config, step, aggregated["rollouts"])
    ahead = SampleAhead(run, sample_ahead or [])  # submitted now: they sample while `train` runs
    trained = run.stage(train_policy_task, "train", cached=False, algorithm_states=states)
    sampled = hand_over_weights(run, ahead)

    run.log_reused()
    metrics = collect_metrics(step, rollouts, algorithms, aggregated, trained, run.timings)
    stages.write_metrics(run.storage, step, metrics)
    return {"step": step, "batch": batch["batch"], "weights": trained["weights"], "reused": run.reused,
            "metrics": metrics, "sampled": sampled}  # the results of `sample_ahead`, in order


class StageOrder:
    """Runs one step's stages in their fixed order, timing each and noting the ones that reused a finished result.

    Each stage waits for the stages before it (`wait_for`), so the UI's graph shows the fixed order of the stages,
    not only the edges of the data they pass.
    """

    def __init__(self, config: Config, step: int):
        self.config, self.step = config, step
        self.storage = RunStorage.of(config)
        self.options = stage_options(self.storage)
        self.sync = config.async_.max_off_policy_steps == 0
        self.timings: dict[str, float] = {}
        self.reused: list[str] = []
        self.before: list = []  # the states of the stage (or fanned-out stages) that ran last

    def given(self, result: dict | None, label: str) -> dict | None:
        """A stage's result that an earlier step computed: its seconds count as the stage's."""
        if result is not None:
            self.timings[label] = result["seconds"]
        return result

    def stage(self, task, label: str, *, resumable: bool = True, cached: bool = True, **kwargs) -> dict:
        """`resumable=False`: run every time, nothing persisted. `cached=False`: persisted, never read back from
        Prefect's cache."""
        options = self.resumable_options(cached) if resumable else {}
        state = self._call(task, label, options, kwargs)
        self.before = [state]
        return state.result()  # raises the stage's error if it failed

    def fan_out(self, task, calls: dict[str, dict]) -> list[dict]:
        """One run of `task` per label, each after the stage before them; the next stage waits for them all."""
        states = [self._call(task, label, self.options, kwargs) for label, kwargs in calls.items()]
        self.before = states
        return [state.result() for state in states]

    def resumable_options(self, cached: bool = True) -> dict:
        # `train` is never taken from Prefect's cache: with ckpt.interval > 1 a resume re-trains steps whose train
        # task once finished (the trainer's state is the newest checkpoint's); the stage itself reuses a step's
        # checkpoint when it exists
        return self.options if cached else {**self.options, "cache_policy": NO_CACHE}

    def log_reused(self) -> None:
        if self.reused:
            get_run_logger().info("step %d: reused the finished stages %s", self.step, ", ".join(self.reused))

    def _call(self, task, label: str, options: dict, kwargs: dict):
        started = time.perf_counter()
        state = task.with_options(**options)(config=self.config, step=self.step, return_state=True,
                                             wait_for=list(self.before), **kwargs)
        self.timings[label] = time.perf_counter() - started
        if state.name == "Cached" or (state.name == "Completed" and state.result().get("reused_checkpoint")):
            self.reused.append(label)
        return state


class SampleAhead:
    """The later steps' `sample_rollouts`, submitted before this step's `train` so that they run beside it.

    They run one after the other, each loading its own scheduled weights into the one sampler, so with them
    nothing is broadcast.
    """

    def __init__(self, run: StageOrder, steps: list[int]):
        self.run, self.steps, self.futures = run, steps, []
        for later in steps:
            task = sample_rollouts_task.with_options(**run.options, task_run_name=f"sample_rollouts-step-{later}")
            self.futures.append(task.submit(config=run.config, step=later, wait_for=self.futures[-1:]))

    def results(self) -> list[dict]:
        if not self.futures:
            return []
        started = time.perf_counter()
        results = [future.result() for future in self.futures]
        self.run.timings["wait_for_sampling"] = time.perf_counter() - started
        self.run.reused += [f"sample_rollouts-step-{later}" for later, future in zip(self.steps, self.futures)
                            if future.state.name == "Cached"]
        return results


def hand_over_weights(run: StageOrder, ahead: SampleAhead) -> list[dict]:
    """The sampler gets this step's weights: broadcast when sampling is synchronous; otherwise each step sampled
    ahead loaded its own scheduled weights, and this returns their results."""
    if run.sync:
        run.stage(broadcast_weights_task, "broadcast_weights", resumable=False)
        return []
    return ahead.results()


def channel_paths(algorithms: list[dict]) -> list[str]:
    return [result["channels"] for result in algorithms]


def collect_metrics(step: int, rollouts: dict, algorithms: list[dict], aggregated: dict, trained: dict,
                    timings: dict[str, float]) -> dict:
    """The step's row in metrics: sampling's, every algorithm's, the batch's and the trainer's, and the stages'
    seconds."""
    metrics: dict = {"step": step, **rollouts["metrics"]}
    for result in algorithms:
        metrics.update(result["stats"])
    metrics.update({f"batch/{k}": v for k, v in aggregated["stats"].items()})
    metrics.update({f"train/{k}": v for k, v in trained["metrics"].items()})
    metrics.update({f"time/{k}": v for k, v in timings.items()})
    return metrics
