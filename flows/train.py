"""`train`: a training run, its steps as `train_step` subflows, so the model stays loaded between steps."""

from __future__ import annotations

import time
from typing import Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Table

from flows.artifacts import history, publish, reward_mean, start_progress, update_progress
from flows.step import train_step
from trace_rl.config import Config
from trace_rl.run import prepare_run

PLOT_EVERY = 5  # the reward plot costs ~0.2 s to draw; the metrics table goes up every step


@flow(name="train", flow_run_name="{config.name}", log_prints=True)
def train(config: Config, mode: Literal["new", "resume", "overwrite"] = "new") -> list[dict]:
    """Run `config.steps` steps, resuming after the latest STABLE checkpoint.

    A retry of this flow run (the UI's Retry, `prefect flow-run retry`) resumes, whatever `mode` was.
    """
    logger = get_run_logger()
    retrying = (flow_run.get_run_count() or 1) > 1
    _, first = prepare_run(config, "resume" if retrying else mode)
    if first > 1:
        logger.info("continuing %s at step %d of %d", config.name, first, config.steps)
    rows = history(config, first - 1)
    progress = start_progress(config, first - 1)
    console = Console(stderr=True)
    done: list[tuple] = []
    with Progress(*Progress.get_default_columns(), TextColumn("{task.fields[last]}"), console=console) as bar:
        task = bar.add_task(config.name, total=config.steps, completed=first - 1, last="")
        for step in range(first, config.steps + 1):
            started = time.perf_counter()
            result = train_step(config, step)
            metrics = {**result["metrics"], "time/step": time.perf_counter() - started}
            rows.append(metrics)
            done.append((step, reward_mean(metrics), metrics.get("train/entropy", 0.0), metrics["time/step"],
                         ", ".join(result["reused"])))
            publish(config, rows, plot=step % PLOT_EVERY == 0 or step == config.steps)
            update_progress(progress, config, step)
            bar.update(task, advance=1, last=f"step {step}: reward {done[-1][1]:.3f}")
    console.print(reward_table(config, done))
    if len(rows) >= 10:
        first, last = (sum(reward_mean(r) for r in part) / 5 for part in (rows[:5], rows[-5:]))
        console.print(f"mean reward of the first 5 steps {first:.3f}, of the last 5 steps {last:.3f} "
                      f"({last - first:+.3f})")
    return [{"step": d[0], "reward_mean": d[1]} for d in done]


def reward_table(config: Config, rows: list[tuple]) -> Table:
    table = Table(title=f"{config.name}: reward per step")
    for column in ("step", "mean reward", "entropy", "seconds", "reused stages"):
        table.add_column(column, justify="left" if column == "reused stages" else "right")
    for step, reward, entropy, seconds, reused in rows:
        table.add_row(str(step), f"{reward:.3f}", f"{entropy:.3f}", f"{seconds:.1f}", reused)
    return table


def run_training(config: Config, resume: bool = False, overwrite: bool = False) -> list[dict]:
    """The CLI's entry: `trace-rl train CONFIG [--resume | --overwrite]`."""
    return train(config, mode="resume" if resume else "overwrite" if overwrite else "new")
