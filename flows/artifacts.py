"""What a run shows in the Prefect UI: a metrics table, a progress bar and a reward curve per run, and a table of a
few rollouts per step."""

from __future__ import annotations

import base64
import io
import re

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from trace_rl.config import Config
from trace_rl.offline.episodes_html import write_episodes_page
from trace_rl.storage import RunStorage, step_name

TABLE_COLUMNS = ("reward_mean", "batch/tokens", "batch/rl_tokens", "batch/ce_tokens", "train/loss/rl",
                 "train/loss/ce", "train/mismatch/k3_kl", "train/grad_norm", "async/policy_lag_max",
                 "async/token_age_mean", "async/token_age_max", "async/dropped_for_age", "partial/in_flight",
                 "partial/carried_tokens", "time/sample_rollouts", "time/train", "time/wait_for_sampling", "time/step")


def artifact_key(config: Config, what: str) -> str:
    """Stable keys (lowercase, digits, dashes) so the UI keeps each artifact's history across steps."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{config.name}-{what}".lower()).strip("-")


def reward_mean(metrics: dict) -> float:
    values = [v for k, v in metrics.items() if k.startswith("rollouts/") and k.endswith("/reward_mean")]
    return sum(values) / len(values) if values else 0.0


def aligned(rows: list[tuple[str, str]]) -> str:
    """`label: value` lines with the values in one column (for the terminal)."""
    width = max(len(label) for label, _ in rows) + 1
    return "\n".join(f"{label + ':':<{width}} {value}" for label, value in rows)


def history(config: Config, upto: int) -> list[dict]:
    """The metrics of steps 1..upto that exist (what a resumed run shows as its past)."""
    storage = RunStorage.of(config)
    paths = [storage.step_path(step, "metrics.json") for step in range(1, upto + 1)]
    return [storage.read_json(p) for p in paths if storage.exists(p)]


def reward_plot(rows: list[dict]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3), dpi=100)
    ax.plot([r["step"] for r in rows], [reward_mean(r) for r in rows], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()


def publish(config: Config, rows: list[dict], plot: bool = True) -> None:
    """The metrics table (and, with `plot`, the reward curve) of every step so far, under the run's stable keys."""
    storage = RunStorage.of(config)
    table = [{"step": r["step"], "reward_mean": round(reward_mean(r), 4),
              **{c: round(r[c], 4) for c in TABLE_COLUMNS[1:] if c in r}} for r in rows]
    create_table_artifact(key=artifact_key(config, "metrics"), table=table,
                          description=f"{config.name}: metrics per step")
    if not plot:
        return
    png = reward_plot(rows)
    storage.write_atomic(storage.path("plots", "reward.png"), png)
    encoded = base64.b64encode(png).decode()
    create_markdown_artifact(
        key=artifact_key(config, "reward-curve"),
        markdown=f"### {config.name}: mean reward by step\n\n![reward](data:image/png;base64,{encoded})\n\n"
                 f"Stored at `{storage.url_of('plots', 'reward.png')}`; last step {step_name(rows[-1]['step'])}.",
        description=f"{config.name}: reward curve",
    )


def publish_rollouts(config: Config, step: int, rows: list[dict]) -> None:
    """The step's table of a few rollouts (`[prefect.rollouts]`; the `aggregate_channels` stage chose them) under the
    run's key `<name>-rollouts`, and a link to the page of all its episodes (`steps/<step>/episodes.html`, written
    here) under `<name>-episodes`: one version of each per step, in its step's flow run."""
    if config.prefect.rollouts.count == 0:
        return
    if rows:
        rows = [{column: as_markdown_text(value) for column, value in row.items()} for row in rows]
        create_table_artifact(key=artifact_key(config, "rollouts"), table=rows,
                              description=f"{config.name}: {len(rows)} rollouts of step {step} "
                                          f"({config.prefect.rollouts.select})")
    page = write_episodes_page(config, step)
    link = f"file://{page}" if "://" not in page else page
    create_link_artifact(link=link, link_text=f"episodes of step {step}", key=artifact_key(config, "episodes"),
                         description=f"{config.name}: every episode of step {step}, token by token")


def as_markdown_text(value):
    """A string as the text it is in the UI, which renders table cells as Markdown and HTML (a model's `<think>` or
    `**` would vanish): each ASCII punctuation character backslash-escaped."""
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", value) if isinstance(value, str) else value


def start_progress(config: Config, done: int) -> str:
    return str(create_progress_artifact(progress=100.0 * done / config.steps, key=artifact_key(config, "progress"),
                                        description=f"{config.name}: steps done of {config.steps}"))


def update_progress(artifact_id: str, config: Config, done: int) -> None:
    update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / config.steps)
