"""One training step as plain functions, one per pipeline stage, in the order they run.

    sample_rollouts -> run_algorithm (one per algorithm) -> validate_dimensions
    -> aggregate_channels -> write_batch -> train -> broadcast_weights

Each stage reads its inputs from the run's storage and returns a small JSON-able
summary with the URLs it wrote, so an orchestrator (the Prefect flow in flows/step.py,
or a plain loop in bench/step.py) passes references, never tensors or trace lists.
Steps are numbered from 1: step `s` samples with the weights of step `s - 1` (0 is the
base model; with `[async]`, of an earlier step: trace_rl.pipeline.schedule) and writes `weights/<s>`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from trace_rl.aio import run_sync
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.algorithms.lookup import load_algorithm
from trace_rl.config import Config
from trace_rl.data.channel import Channel
from trace_rl.data.trace import Trace
from trace_rl.data.validate import validate_channels
from trace_rl.names import LOSS_NAMES, POLICY
from trace_rl.pipeline.channels import channel_stats, sum_channels
from trace_rl.pipeline.rollout_table import rollout_rows
from trace_rl.pipeline.schedule import check_staleness, lag_metrics
from trace_rl.pipeline.session import Session
from trace_rl.pipeline.token_age import age_metrics, mask_stale
from trace_rl.remote.client import remote_server_for, run_remote_algorithm
from trace_rl.storage import RunStorage, step_name
from trace_rl.tables import read_channels, read_samples, read_traces, write_channels, write_samples, write_traces
from trace_rl.tables import write_batch as write_batch_table

AGGREGATED = "aggregated.parquet"  # the step's samples as aggregated, before the reference scores them


@dataclass(frozen=True)
class AlgorithmJob:
    """One algorithm task of a step: an algorithm config, the envs that list it, and where it runs."""

    position: int
    config: AlgorithmConfig
    envs: tuple[str, ...]
    server: str | None = None

    @property
    def key(self) -> str:
        return f"{self.position:02d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', self.config.id)}"


def algorithm_jobs(config: Config) -> list[AlgorithmJob]:
    """The step's algorithm tasks in first-listed order; one per distinct (config, server) pair."""
    jobs: dict[tuple[str, str | None], tuple[AlgorithmConfig, list[str]]] = {}
    for env in config.env:
        for algo in config.algorithms_for(env):
            server = remote_server_for(env, algo)
            key = (algo.model_dump_json(), server)
            jobs.setdefault(key, (algo, []))[1].append(env.id)
    return [
        AlgorithmJob(position=i, config=algo, envs=tuple(dict.fromkeys(envs)), server=server)
        for i, ((_, server), (algo, envs)) in enumerate(jobs.items())
    ]


def channels_path(storage: RunStorage, step: int, job: AlgorithmJob, suffix: str) -> str:
    return storage.path("steps", step_name(step), "channels", f"{job.key}.{suffix}")


# -- stages -------------------------------------------------------------------------------


def sample_rollouts(session: Session, step: int) -> dict:
    """The step's traces, sampled with the weights the schedule gives it (trace_rl.pipeline.schedule); `seconds` is what
    sampling took, wherever it ran (with `[async]`, often during an earlier step's training)."""
    from trace_rl.pipeline.rollouts import play_rollouts

    async def play() -> tuple:
        models = await session.models_at(step)
        if session.config.async_.partial_rollout_tokens is None:
            return await play_rollouts(session.config, models, step)
        from trace_rl.pipeline.partial import play_partial_rollouts

        return await play_partial_rollouts(session.config, models, step, session.storage)

    started = time.perf_counter()
    traces, summary = run_sync(play())
    path = write_traces(session.storage, step, traces)
    metrics = summary.metrics()
    if session.config.actor == POLICY:
        metrics.update({**lag_metrics(traces, step), **age_metrics(traces, step)})
    return {"traces": path, "summary": summary.model_dump(), "metrics": metrics,
            "seconds": time.perf_counter() - started}


async def compute_channels(
    session: Session, step: int, job: AlgorithmJob, traces: list[Trace], state: dict
) -> tuple[list[Channel], dict]:
    """Run one algorithm (in-process or on its env server) on the traces of its envs: (channels, new state)."""
    traces = [t for t in traces if t.env in job.envs]
    if job.server is not None:
        channels = await run_remote_algorithm(
            job.server, job.config, traces, session.runtimes.configs, session.config.remote
        )
        return channels, {}
    from trace_rl.algorithms.runner import apply_algorithm

    algorithm = load_algorithm(job.config)
    await algorithm.setup(await session.models_for(step, algorithm.models_used(algorithm.options)))
    algorithm.load_state_dict(state)
    channels = await apply_algorithm(algorithm, traces)
    return channels, algorithm.state_dict()


def run_algorithm(session: Session, step: int, job: AlgorithmJob) -> dict:
    """The stage: channels (and state, if the algorithm keeps any) written next to the step's traces."""
    storage = session.storage
    traces = read_traces(storage, step)
    channels, state = run_sync(compute_channels(session, step, job, traces,
                                                previous_algorithm_state(session, step, job)))
    path = channels_path(storage, step, job, "parquet")
    write_channels(storage, path, channels)
    if state:
        storage.write_json(channels_path(storage, step, job, "state.json"), state)
    return {"channels": path, "algorithm": job.config.id, "stats": channel_stats(channels)}


def previous_algorithm_state(session: Session, step: int, job: AlgorithmJob) -> dict:
    """The algorithm's state after step `step - 1` (empty at the first step): from that step's checkpoint, or,
    for a step without one (`ckpt.interval` > 1), from the state file its run_algorithm stage wrote."""
    if step <= 1:
        return {}
    from trace_rl.trainer.checkpoint import checkpoint_dir, load_part

    if session.storage.is_stable(checkpoint_dir(session.storage, step - 1)):
        extra = load_part(session.storage, step - 1, "extra_state") or {}
        return extra.get("algorithms", {}).get(job.key, {})
    path = channels_path(session.storage, step - 1, job, "state.json")
    return session.storage.read_json(path) if session.storage.exists(path) else {}


def read_step(session: Session, step: int, channel_paths: list[str], out: RunStorage) -> tuple[list[Trace], list[Channel]]:
    """The step's traces (in the run's storage) and the channels at `channel_paths` (in `out`)."""
    return read_traces(session.storage, step), [c for path in channel_paths for c in read_channels(out, path)]


# validate -> aggregate -> write: each reads its inputs from storage and writes its output there (`out`: the run's
# storage, or a replay's --out), so a step resumed in another process redoes none of the finished ones


def validate_dimensions(session: Session, step: int, channel_paths: list[str], out: RunStorage | None = None) -> dict:
    """Every channel checked against its branch (a failure names env, trace, branch and algorithm); writes nothing."""
    traces, channels = read_step(session, step, channel_paths, out or session.storage)
    if session.config.actor == POLICY and session.config.async_.partial_rollout_tokens is None:
        check_staleness(traces, step, session.config.async_.max_off_policy_steps)  # partial: token_age masks
    validate_channels(traces, channels)
    return {"channels": len(channels), "branches": sum(len(t.branches) for t in traces)}


def aggregate_channels(session: Session, step: int, channel_paths: list[str], out: RunStorage | None = None) -> dict:
    """One training sample per branch, same-loss channels summed, into the step's `aggregated.parquet`: its URL
    (`aggregated`), the batch's token counts (`stats`) and the rows of the step's rollout table (`rollouts`,
    trace_rl.pipeline.rollout_table), which the flow shows in the UI."""
    out = out or session.storage
    traces, channels = read_step(session, step, channel_paths, out)
    samples = sum_channels(traces, channels)
    masked = mask_stale(samples, step, session.config.token_age_bound) \
        if session.config.actor == POLICY else 0
    stats = {
        "age_masked_tokens": masked,
        "samples": len(samples),
        "tokens": int(sum(len(s) for s in samples)),
        **{f"{loss}_tokens": int(sum(getattr(s, f"{loss}_mask").sum() for s in samples)) for loss in LOSS_NAMES},
    }
    return {"aggregated": write_samples(out, out.step_path(step, AGGREGATED), samples), "stats": stats,
            "rollouts": rollout_rows(session.config, step, traces, channels)}


def write_batch(session: Session, step: int, aggregated: str, out: RunStorage | None = None) -> dict:
    """The step's batch.parquet from its aggregated samples; with `[trainer.loss.kl]` the reference scores every
    sample first, once, and its logprobs are the batch's `ref_logprobs` column (the stage's task is what a resume
    reuses)."""
    from trace_rl.pipeline.reference import with_reference_logprobs

    out = out or session.storage
    samples = run_sync(with_reference_logprobs(session, step, read_samples(out, aggregated)))
    return {"batch": write_batch_table(out, step, samples), "samples": len(samples)}


def train(session: Session, step: int, algorithm_states: dict[str, str]) -> dict:
    """One optimizer step on the batch; checkpoint (with the algorithms' states) and weights for `step`.

    Idempotent: when the process died after the checkpoint of `step` became STABLE, the step
    is not trained again; missing weights are exported from that checkpoint.
    """
    storage = session.storage
    weights = storage.path("weights", step_name(step))
    metrics_path = storage.step_path(step, "train_metrics.json")
    if step in storage.stable_steps("checkpoints"):
        if not storage.is_stable(weights):
            session.trainer.export_weights(step)
        metrics = storage.read_json(metrics_path) if storage.exists(metrics_path) else {}
        return {"weights": weights, "metrics": metrics, "reused_checkpoint": True}
    states = {key: storage.read_json(path) for key, path in algorithm_states.items() if storage.exists(path)}
    run_sync(session.sleep_engines())
    metrics = session.trainer.run_step(step, extra_state={"algorithms": states})
    storage.write_json(metrics_path, metrics)
    return {"weights": weights, "metrics": metrics}


def broadcast_weights(session: Session, step: int) -> dict:
    """Make the sampler run the weights step `step + 1` samples with (those of `step`, without `[async]`), after
    waking the engines that slept for a colocated trainer."""
    run_sync(session.after_training(step))
    return {"policy_step": session.policy_step}


def algorithm_state_paths(storage: RunStorage, step: int, jobs: list[AlgorithmJob]) -> dict[str, str]:
    return {job.key: channels_path(storage, step, job, "state.json") for job in jobs}


def write_metrics(storage: RunStorage, step: int, metrics: dict) -> str:
    path = storage.step_path(step, "metrics.json")
    storage.write_json(path, metrics)
    return path


def run_step(session: Session, step: int) -> dict:
    """The whole step without an orchestrator, stage by stage (what bench/step.py compares Prefect to)."""
    rollouts = sample_rollouts(session, step)
    jobs = algorithm_jobs(session.config)
    results = [run_algorithm(session, step, job) for job in jobs]
    paths = [r["channels"] for r in results]
    validate_dimensions(session, step, paths)
    aggregated = aggregate_channels(session, step, paths)
    batch = write_batch(session, step, aggregated["aggregated"])
    trained = train(session, step, algorithm_state_paths(session.storage, step, jobs))
    broadcast_weights(session, step)
    return {"rollouts": rollouts, "algorithms": results, "aggregate": aggregated, "batch": batch, "train": trained}
