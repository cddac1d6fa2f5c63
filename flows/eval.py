"""`eval`: held-out evaluation of a run's weights of one step (trace_rl/eval/evaluation.py, docs/eval.md).

`train` runs it as a subflow every `[eval] interval` steps; `trace-rl eval RUN --step N` and the
`<name>-eval` deployment of `trace-rl serve` run it on demand on a finished step's weights.
"""

from __future__ import annotations

from contextvars import ContextVar

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from flows.artifacts import artifact_key
from trace_rl.config import Config
from trace_rl.eval.evaluation import check_eval, tracker_metrics
from trace_rl.eval.evaluation import evaluate as evaluate_step
from trace_rl.pipeline.session import session_for
from trace_rl.aio import run_sync
from trace_rl.runs.tracking import Trackers

# progress(done, total) after each eval sample, for the caller's progress bar (a callable is no flow parameter)
PROGRESS: ContextVar = ContextVar("eval_progress", default=None)


@flow(name="eval", flow_run_name="{config.name}-eval-{step}", log_prints=True)
def eval_flow(config: Config, step: int, track: bool = True) -> list[dict]:
    """Evaluate the weights of `step` (0: the base model) on `[eval] envs`; a finished eval is read back.

    The metrics go to eval/step_<step>/metrics.parquet, a table artifact and, with `track`, the run's trackers
    (`train` passes track=False and logs them into the trackers it holds open)."""
    check_eval(config, step)
    session = session_for(config)
    result = run_sync(evaluate_step(session, step, PROGRESS.get()))
    rows = result["metrics"]
    if result["reused"]:
        get_run_logger().info("step %d: eval already finished, read back from %s", step, session.storage.url)
    create_table_artifact(key=artifact_key(config, "eval"), table=[rounded(row) for row in rows],
                          description=f"{config.name}: eval of the weights of step {step}")
    if track and config.logging.backends:
        with Trackers(config, session.storage) as trackers:
            trackers.log_metrics(tracker_metrics(rows), step)
    return rows


def rounded(row: dict) -> dict:
    return {key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()}


def eval_table(config: Config, rows: list[dict]) -> Table:
    """The eval rows for the terminal: a line per metric, a column per env (narrow enough for a log file)."""
    step = rows[0]["step"] if rows else 0
    table = Table(title=f"{config.name}: eval of step {step}")
    table.add_column("metric")
    for row in rows:
        table.add_column(row["env"], justify="right")
    for metric in [key for key in rows[0] if key not in ("env", "step")] if rows else []:
        table.add_row(metric, *[f"{row[metric]:.3f}" if isinstance(row[metric], float) else str(row[metric])
                                for row in rows])
    return table


def evaluate_with_progress(config: Config, step: int, bar: Progress, track: bool = True) -> list[dict]:
    """The eval flow, its samples counted on a line of `bar` while it runs."""
    task = bar.add_task(f"eval of step {step}", total=None, last="")
    token = PROGRESS.set(lambda done, total: bar.update(task, completed=done, total=total))
    try:
        return eval_flow(config, step, track=track)
    finally:
        PROGRESS.reset(token)
        bar.remove_task(task)


def run_eval(config: Config, step: int) -> list[dict]:
    """The CLI's entry: `trace-rl eval RUN --step N`."""
    console = Console(stderr=True)
    with Progress(*Progress.get_default_columns(), console=console, disable=not console.is_terminal) as bar:
        rows = evaluate_with_progress(config, step, bar)
    console.print(eval_table(config, rows))
    return rows
