"""`replay`: a run's saved traces through new algorithms, offline, into new batches (and optionally a model)."""

from __future__ import annotations

from prefect import flow
from rich.console import Console
from rich.table import Table

from tasks.replay_step import replay_step
from tasks.train_replayed import train_replayed
from trace_rl import replay as lib
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.storage import RunStorage


@flow(name="replay", log_prints=True)
def replay(run: str, algorithms: list[AlgorithmConfig], out: str, steps: str | None = None, train: bool = False,
           from_step: int | None = None, model: str | None = None, storage_options: dict | None = None,
           overwrite: bool = False) -> list[dict]:
    source = lib.source_config(run, storage_options)
    config = lib.replay_config(source, algorithms)
    out_storage = RunStorage.from_url(out, storage_options)
    source_storage = RunStorage.from_url(run, storage_options)
    if out_storage.url == source_storage.url:
        raise ValueError(f"--out {out} is the source run itself; replay never writes over the original run")
    lib.prepare_out(out_storage, overwrite)
    chosen = lib.parse_steps(steps, lib.saved_steps(source_storage))
    from trace_rl.session import session_for
    from trace_rl.step import algorithm_jobs

    states = lib.initial_states(session_for(config), chosen[0], algorithm_jobs(config)) if chosen else {}
    summaries = []
    for step in chosen:
        result = replay_step(config=config, out_url=out_storage.url, step=step, states=states)
        states = result.pop("states")
        summaries.append(result)
    out_storage.write_json(out_storage.path("replay.json"), {
        "source": source_storage.url, "algorithms": [a.model_dump() for a in algorithms], "steps": chosen})
    Console(stderr=True).print(comparison_table(summaries))
    if train and chosen:
        start = model or source.model.name
        if from_step is not None:
            from trace_rl.inference.broadcast import stage_weights

            start = stage_weights(source_storage, from_step)
        train_replayed(config=lib.train_config(config, out_storage, start), steps=chosen)
    return summaries


def comparison_table(summaries: list[dict]) -> Table:
    table = Table(title="replayed batches vs the original run")
    for column in ("step", "rl tokens (orig → new)", "rl mean (orig → new)", "ce tokens (orig → new)",
                   "ce mean (orig → new)", "per-algorithm channels"):
        table.add_column(column)
    for s in summaries:
        o, n = s["original"], s["replayed"]

        def pair(key: str, fmt: str) -> str:
            return f"{format(o[key], fmt) if key in o else '—'} → {format(n[key], fmt)}"

        channels = "; ".join(
            f"{key.split('/')[1]}: {int(value)} tok" for key, value in s["channels"].items() if key.endswith("/tokens"))
        table.add_row(str(s["step"]), pair("rl_tokens", ".0f"), pair("rl_mean", "+.4f"), pair("ce_tokens", ".0f"),
                      pair("ce_mean", "+.4f"), channels)
    return table
