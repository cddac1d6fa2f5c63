"""The pipeline's Prefect tasks: one stage each, a thin wrapper over `trace_rl.pipeline.step` (or, for replay,
`trace_rl.offline.replay` and the trainer). Each takes the run's config and a step, and returns a small dict of
storage URLs and statistics, never tensors."""

from __future__ import annotations

from prefect import task

from trace_rl.config import Config
from trace_rl.offline import replay
from trace_rl.pipeline import step as stages
from trace_rl.pipeline.session import session_for
from trace_rl.storage import RunStorage
from trace_rl.trainer.lifecycle import RunTrainer


@task(name="sample_rollouts", task_run_name="sample_rollouts")
def sample_rollouts_task(config: Config, step: int) -> dict:
    """Every env's groups with the actor, written to steps/<step>/traces.parquet."""
    return stages.sample_rollouts(session_for(config), step)


@task(name="run_algorithm", task_run_name="{job.config.id}")
def run_algorithm_task(config: Config, step: int, job: stages.AlgorithmJob) -> dict:
    """One algorithm (builtin in-process, or env-owned on its env server) over its envs' traces."""
    return stages.run_algorithm(session_for(config), step, job)


@task(name="validate_dimensions", task_run_name="validate_dimensions")
def validate_dimensions_task(config: Config, step: int, channel_paths: list[str]) -> dict:
    """Every channel checked against its branch; a failure names env, trace, branch and algorithm."""
    return stages.validate_dimensions(session_for(config), step, channel_paths)


@task(name="aggregate_channels", task_run_name="aggregate_channels")
def aggregate_channels_task(config: Config, step: int, channel_paths: list[str]) -> dict:
    """One training sample per branch, same-loss channels summed, into steps/<step>/aggregated.parquet."""
    return stages.aggregate_channels(session_for(config), step, channel_paths)


@task(name="write_batch", task_run_name="write_batch")
def write_batch_task(config: Config, step: int, aggregated: str) -> dict:
    """steps/<step>/batch.parquet in the run's storage, from the aggregated samples."""
    return stages.write_batch(session_for(config), step, aggregated)


# the task is `train_policy`, apart from the `train` flow; its runs keep the name `train` in the UI's graph
@task(name="train_policy", task_run_name="train")
def train_policy_task(config: Config, step: int, algorithm_states: dict[str, str]) -> dict:
    """One optimizer step; checkpoints/<step> and weights/<step>, each STABLE."""
    return stages.train(session_for(config), step, algorithm_states)


@task(name="broadcast_weights", task_run_name="broadcast_weights")
def broadcast_weights_task(config: Config, step: int) -> dict:
    """The actor samples with weights/<step> from the next step on."""
    return stages.broadcast_weights(session_for(config), step)


@task(name="replay_step", task_run_name="replay-step-{step}")
def replay_step_task(config: Config, out_url: str, step: int, states: dict[str, dict]) -> dict:
    """One saved step's traces through the replay algorithms, into `<out>/steps/<step>/batch.parquet`."""
    out = RunStorage.from_url(out_url, config.storage_options)
    summary = replay.replay_step(session_for(config), out, step, stages.algorithm_jobs(config), states)
    return {**summary, "states": states}


@task(name="train_replayed")
def train_replayed_task(config: Config, steps: list[int]) -> list[dict]:
    """Train `config.model` offline on the replayed batches, one optimizer step per replayed step."""
    with RunTrainer(config, RunStorage.of(config)) as trainer:
        return [{"step": step, **metrics} for step, metrics in zip(steps, trainer.run_steps(steps))]
