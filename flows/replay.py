"""`replay`: a run's saved traces (or a file of verifiers trace records) through new algorithms, offline, into new
batches (and optionally a model)."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for
from rich import box
from rich.console import Console
from rich.table import Table

from flows.artifacts import aligned, reward_mean
from flows.tasks import replay_step_task, train_replayed_task
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.offline import replay as lib
from trace_rl.storage import RunStorage, step_name


@flow(name="replay", log_prints=True)
def replay_flow(run: str | None, algorithms: list[AlgorithmConfig], out: str, steps: str | None = None,
           train: bool = False, from_step: int | None = None, model: str | None = None,
           storage_options: dict | None = None, overwrite: bool = False, overrides: list[str] = (),
           traces: str | None = None) -> list[dict]:
    """Replay the run `run`, or with `traces` (and `run` None) a file of verifiers v1 trace records."""
    lib.check_source(run, traces)
    if traces is not None:
        plan = lib.check_records_replay(traces, algorithms, out, steps, overwrite, storage_options, overrides)
    else:
        plan = lib.check_replay(run, algorithms, out, steps, overwrite, storage_options, overrides)
    lib.check_train_start(plan.source, plan.source_storage, train, from_step, model, records=traces is not None)
    config, out_storage, chosen = plan.config, plan.out, plan.steps
    lib.prepare_out(out_storage)
    lib.stage_records(plan)
    from trace_rl.pipeline.session import session_for
    from trace_rl.pipeline.step import algorithm_jobs

    states = lib.initial_states(session_for(config), chosen[0], algorithm_jobs(config)) if chosen else {}
    summaries = []
    for step in chosen:
        result = replay_step_task(config=config, out_url=out_storage.url, step=step, states=states)
        states = result.pop("states")
        summaries.append(result)
    out_storage.write_json(out_storage.path("replay.json"), {
        "source": traces if traces is not None else plan.source_storage.url,
        "algorithms": [a.model_dump() for a in algorithms], "steps": chosen})
    console = Console(stderr=True)
    ids = [a.id for a in algorithms]
    console.print(comparison_table(summaries, ids))
    for algorithm in idle_algorithms(summaries, ids):
        console.print(f"{algorithm} contributed no tokens in any replayed step: its mask selected nothing in these "
                      "traces", highlight=False, soft_wrap=True)
    rows = [("replayed batches", out_storage.url)]
    if train and chosen:
        start = model or plan.source.model.name
        if from_step:  # 0: the run's base model
            from trace_rl.inference.broadcast import stage_weights

            start = stage_weights(plan.source_storage, from_step)
        trained = train_replayed_task(config=lib.train_config(config, out_storage, start, envs=traces is None),
                                 steps=chosen)
        rewards = record_rewards(plan.records) if traces is not None else source_rewards(plan.source_storage, chosen)
        console.print(training_table(trained, rewards))
        rows.append((f"weights of step {chosen[-1]}", out_storage.url_of("weights", step_name(chosen[-1]))))
    rows.append(("this replay in the UI", url_for("flow-run", obj_id=flow_run.get_id())))
    console.print(aligned(rows), highlight=False, soft_wrap=True)
    return summaries


def comparison_table(summaries: list[dict], algorithms: list[str]) -> Table:
    """Per step, the original batch above the replayed one (when the source has batches: a records file has
    none), and the tokens each algorithm masked."""
    originals = any(s["original"] for s in summaries)
    table = Table(title="replayed batches vs the original run" if originals else "replayed batches",
                  box=box.SIMPLE_HEAD)
    for column in ("step", "batch", "rl tokens", "rl mean", "ce tokens", "ce mean", "tokens by algorithm"):
        table.add_column(column, justify="left" if column in ("batch", "tokens by algorithm") else "right")
    for s in summaries:
        by_algorithm = "\n".join(f"{a} {tokens(s, a) or 'none'}" for a in algorithms)
        if originals:
            table.add_row(str(s["step"]), "original", *batch_cells(s["original"]), "")
        table.add_row("" if originals else str(s["step"]), "replayed", *batch_cells(s["replayed"]), by_algorithm,
                      end_section=True)
    return table


def batch_cells(stats: dict) -> list[str]:
    if not stats:  # the source run kept no batch for this step
        return ["—"] * 4
    return [f"{stats['rl_tokens']:.0f}", f"{stats['rl_mean']:+.4f}", f"{stats['ce_tokens']:.0f}",
            f"{stats['ce_mean']:+.4f}"]


def tokens(summary: dict, algorithm: str) -> int:
    return int(summary["channels"].get(f"channel/{algorithm}/tokens", 0))


def idle_algorithms(summaries: list[dict], algorithms: list[str]) -> list[str]:
    return [a for a in algorithms if summaries and not any(tokens(s, a) for s in summaries)]


def source_rewards(source: RunStorage, steps: list[int]) -> dict[int, float]:
    """The mean reward of each replayed step's traces, from the source run's metrics."""
    paths = {step: source.step_path(step, "metrics.json") for step in steps}
    return {step: reward_mean(source.read_json(path)) for step, path in paths.items() if source.exists(path)}


def record_rewards(records: dict[int, list]) -> dict[int, float]:
    """The mean reward of each replayed step's records."""
    return {step: sum(t.reward for t in traces) / len(traces) for step, traces in records.items() if traces}


def training_table(trained: list[dict], rewards: dict[int, float]) -> Table:
    table = Table(title="training on the replayed batches", box=box.SIMPLE_HEAD)
    for column in ("step", "loss rl", "loss ce", "grad norm", "reward of the traces"):
        table.add_column(column, justify="right")
    for row in trained:
        reward = rewards.get(row["step"])
        table.add_row(str(row["step"]), f"{row.get('loss/rl', 0.0):+.4f}", f"{row.get('loss/ce', 0.0):+.4f}",
                      f"{row.get('grad_norm', 0.0):.4f}", "—" if reward is None else f"{reward:.3f}")
    return table
