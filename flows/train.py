"""`train`: a training run, its steps as `train_step` subflows, so the model stays loaded between steps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Literal
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for
from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Table

from flows import quiet
from flows.artifacts import aligned, history, publish, reward_mean, start_progress, update_progress
from flows.eval import eval_table, evaluate_with_progress
from flows.liveness import crash_gone_runs, crash_orphaned_subflows, label_this_flow_run, without_heartbeat
from flows.step import step_flow
from trace_rl.config import Config
from trace_rl.eval.evaluation import evaluates_at, tracker_metrics
from trace_rl.pipeline.schedule import sampled_while_training
from trace_rl.pipeline.session import finish_checkpoint_writes
from trace_rl.runs.start import finished_message, prepare_run
from trace_rl.runs.tracking import Trackers, step_metrics
from trace_rl.storage import RunStorage, eval_dir, step_name

PLOT_EVERY = 5  # the reward plot costs ~0.2 s to draw; the metrics table goes up every step


@flow(name="train", flow_run_name="{config.name}", log_prints=True)
def train_flow(config: Config, mode: Literal["new", "resume", "overwrite"] = "new") -> list[dict]:
    """Run `config.steps` steps, resuming after the latest STABLE checkpoint.

    A retry of this flow run (the UI's Retry, `prefect flow-run retry`) resumes, whatever `mode` was.
    """
    logger = get_run_logger()
    quiet.prefect_console_skips_printed_lines()
    console = Console(stderr=True)
    retrying = (flow_run.get_run_count() or 1) > 1
    finish_checkpoint_writes()  # an earlier flow run's: where this one starts counts them
    storage, first = prepare_run(config, "resume" if retrying else mode)
    label_this_flow_run(storage.url)
    this_run = url_for("flow-run", obj_id=flow_run.get_id())
    took_over = f"taken over by flow run {flow_run.get_id()} ({'resume' if retrying else mode}): {this_run}"
    for gone in crash_gone_runs(storage.url, took_over, keep=UUID(flow_run.get_id())):
        say(logger, console, f"marked the earlier flow run {gone.id} of {config.name} Crashed: its process is gone")
    crash_orphaned_subflows(took_over)
    finished = finished_message(config, storage)
    if finished is not None:  # a resume of a finished run (`trace-rl train` says so before starting a flow run)
        say(logger, console, finished)
        return []
    if first > 1:
        say(logger, console, f"continuing {config.name} at step {first} of {config.steps}")
    if config.async_.partial_rollout_tokens is not None and config.async_.max_token_age is None:
        say(logger, console, f"async.max_token_age unset: {config.token_age_bound} (max_off_policy_steps "
                             f"{config.async_.max_off_policy_steps} + {config.max_segments} segments a rollout can need)")
    rows = history(config, first - 1)
    progress = start_progress(config, first - 1)
    done: list[tuple] = []
    # on a terminal one live line (rich); in a log file a plain line per step
    with Progress(*Progress.get_default_columns(), TextColumn("{task.fields[last]}"), console=console,
                  disable=not console.is_terminal) as bar, Trackers(config, storage) as trackers:
        task = bar.add_task(config.name, total=config.steps, completed=first - 1, last="")
        # an eval the last process did not finish (it died between a step and its eval)
        unfinished = [s for s in range(1, first)
                      if evaluates_at(config, s) and not storage.is_stable(eval_dir(storage, s))]
        for step in unfinished:
            run_eval_of_step(config, step, bar, console, trackers)
        for step, result in trained_steps(config, first):
            metrics = result["metrics"]
            rows.append(metrics)
            done.append((step, reward_mean(metrics), metrics.get("train/entropy", 0.0), metrics["time/step"],
                         ", ".join(result["reused"])))
            publish(config, rows, plot=step % PLOT_EVERY == 0 or step == config.steps)
            update_progress(progress, config, step)
            trackers.log_metrics(step_metrics(metrics, reward_mean(metrics)), step)
            line = step_line(config, metrics, done[-1][-1])
            logger.info(line, extra=quiet.PRINTED)  # the UI's log of this flow run
            bar.update(task, advance=1, last=line)
            if not console.is_terminal:
                console.print(line, highlight=False, soft_wrap=True)
            if evaluates_at(config, step):
                run_eval_of_step(config, step, bar, console, trackers)
    console.print(reward_table(config, done))
    if len(rows) >= 10:
        first, last = (sum(reward_mean(r) for r in part) / 5 for part in (rows[:5], rows[-5:]))
        console.print(f"mean reward of the first 5 steps {first:.3f}, of the last 5 steps {last:.3f} "
                      f"({last - first:+.3f})")
    console.print(where_things_are(storage, config.steps, this_run), highlight=False, soft_wrap=True)
    return [{"step": d[0], "reward_mean": d[1]} for d in done]


def trained_steps(config: Config, first: int) -> Iterator[tuple[int, dict]]:
    """The run's loop: steps `first` .. `config.steps`, each a `step_flow` subflow, yielding each step with its
    result (its metrics with the step's wall time, `time/step`). With `[async]` a step also samples the steps after it;
    the loop hands their rollouts to them."""
    sampled: dict[int, dict] = {}  # `sample_rollouts` results of steps an earlier step sampled
    for step in range(first, config.steps + 1):
        started = time.perf_counter()
        ahead = sampled_while_training(step, config.async_.max_off_policy_steps, max(sampled, default=step),
                                       config.steps)
        with without_heartbeat():
            result = step_flow(config, step, rollouts=sampled.pop(step, None), sample_ahead=ahead)
        sampled.update(zip(ahead, result["sampled"]))
        yield step, {**result, "metrics": {**result["metrics"], "time/step": time.perf_counter() - started}}


def run_eval_of_step(config: Config, step: int, bar: Progress, console: Console, trackers: Trackers) -> None:
    """The eval subflow on the weights of `step`, its metrics into the run's trackers and onto the terminal."""
    with without_heartbeat():
        rows = evaluate_with_progress(config, step, bar, track=False)
    trackers.log_metrics(tracker_metrics(rows), step)
    console.print(eval_table(config, rows))


def say(logger, console: Console, message: str) -> None:
    """To the flow run's log (the UI) and to the terminal, once."""
    logger.info(message, extra=quiet.PRINTED)
    console.print(message, highlight=False, soft_wrap=True)


def step_line(config: Config, metrics: dict, reused: str) -> str:
    """`step 2/3: reward 0.039, entropy 5.733, 96 tokens, 1.1 s`, then the stages reused, failed traces and retries."""
    line = (f"step {metrics['step']}/{config.steps}: reward {reward_mean(metrics):.3f}, entropy "
            f"{metrics.get('train/entropy', 0.0):.3f}, {metrics.get('batch/tokens', 0):.0f} tokens, "
            f"{metrics['time/step']:.1f} s")
    if reused:
        line += f" (reused {reused})"
    errors, traces = (sum(v for k, v in metrics.items() if k.startswith("rollouts/") and k.endswith(f"/{name}"))
                      for name in ("errors", "traces"))
    warnings = [f"{errors:.0f} of {traces:.0f} traces failed"] if errors else []
    if metrics.get("rollouts/retries"):
        warnings.append(f"{metrics['rollouts/retries']:.0f} retries")
    return f"{line}; warning: {', '.join(warnings)}" if warnings else line


def where_things_are(storage: RunStorage, last_step: int, flow_run_url: str) -> str:
    """Where the run's files, its last weights and its flow run are, one per line."""
    weights = storage.url_of("weights", step_name(last_step))
    if not storage.is_stable(storage.path("weights", step_name(last_step))):
        weights += " (not written yet)"
    return aligned([("run directory", storage.url), (f"weights of step {last_step}", weights),
                    ("this run in the UI", flow_run_url)])


def reward_table(config: Config, rows: list[tuple]) -> Table:
    table = Table(title=f"{config.name}: reward per step")
    for column in ("step", "mean reward", "entropy", "seconds", "reused stages"):
        table.add_column(column, justify="left" if column == "reused stages" else "right")
    for step, reward, entropy, seconds, reused in rows:
        table.add_row(str(step), f"{reward:.3f}", f"{entropy:.3f}", f"{seconds:.1f}", reused)
    return table


def run_training(config: Config, resume: bool = False, overwrite: bool = False) -> list[dict]:
    """The CLI's entry: `trace-rl train CONFIG [--resume | --overwrite]`."""
    return train_flow(config, mode="resume" if resume else "overwrite" if overwrite else "new")
