"""Offline replay: saved traces through new algorithms, into new batches under another URL.

The source run is only read. Each replayed step writes `steps/<step>/channels/*.parquet`,
`steps/<step>/aggregated.parquet` and `steps/<step>/batch.parquet` under `--out`; with `--train`, a model trains on the
replayed batches there (checkpoints and weights under `--out` too).

The source is a run (`--run`) or a file of verifiers v1 trace records (`--traces`, trace_rl.verifiers.records):
those traces are written to `--out` as each step's `traces.parquet` first, and replay from there. A records replay's
config is trace-rl's defaults with its `--set` overrides; its `[[env]]` entries only name where the traces came from.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from typing import Any

import numpy as np

from trace_rl.algorithms.base import AlgorithmConfig, validate_options
from trace_rl.algorithms.lookup import resolve_algorithm_class
from trace_rl.config import Config, ConfigError, apply_override
from trace_rl.data.sample import TrainingSample
from trace_rl.data.trace import Trace
from trace_rl.aio import run_sync
from trace_rl.errors import RefusedError
from trace_rl.names import LOSS_NAMES, POLICY
from trace_rl.pipeline.channels import channel_stats
from trace_rl.pipeline.schedule import sampling_weights
from trace_rl.pipeline.session import Session
from trace_rl.pipeline.step import (
    AlgorithmJob,
    aggregate_channels,
    algorithm_jobs,
    channels_path,
    compute_channels,
    validate_dimensions,
    write_batch,
)
from trace_rl.pipeline.token_age import token_ages
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage, check_run_version, check_wipe, overlap
from trace_rl.tables import read_batch, read_traces, write_channels, write_traces


def parse_algorithms(text: str) -> list[AlgorithmConfig]:
    """`'["opd", {id="echo", user={alpha=0.5}}]'` (a TOML array) into algorithm configs."""
    try:
        value = tomllib.loads(f"algorithms = {text}")["algorithms"]
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"--algorithms: not a TOML array ({exc}); e.g. '[\"grpo\", {{id=\"echo\"}}]'"]) from None
    if not isinstance(value, list) or not value:
        raise ConfigError(["--algorithms: give a non-empty array, e.g. '[\"grpo\"]'"])
    return [AlgorithmConfig.parse(v) for v in value]


@dataclass
class ReplayPlan:
    source: Config  # the source run's config (a records replay: its config)
    config: Config  # the source config with the replayed algorithms
    source_storage: RunStorage  # a records replay: `out`, where its traces are staged
    out: RunStorage
    steps: list[int]
    records: dict[int, list[Trace]] | None = None  # a records replay: the traces of each chosen step


def check_replay(run: str, algorithms: list[AlgorithmConfig], out: str, steps: str | None = None,
                 overwrite: bool = False, storage_options: dict[str, Any] | None = None,
                 overrides: list[str] = ()) -> ReplayPlan:
    """Everything a replay needs, checked before it writes anything: the source run and its saved steps,
    the algorithms (ConfigError), and an `--out` that neither is, holds nor lies inside the source run and,
    without `--overwrite`, is empty (RefusedError: its batches and checkpoints would mix with the new ones);
    with `--overwrite`, one that `check_wipe` lets be wiped. `overrides` (`--set KEY=VALUE`) change the source
    run's config, e.g. to add the `[models.reference]` an `opd` replay scores with."""
    source = source_config(run, storage_options, overrides)
    config = replay_config(source, algorithms)
    source_storage = RunStorage.from_url(run, storage_options)
    out_storage = RunStorage.from_url(out, storage_options)
    relation = overlap(out_storage, source_storage)
    if relation is not None:
        itself = " itself" if relation == "is" else ""
        raise RefusedError(f"--out {out_storage.url} {relation} the source run {source_storage.url}{itself}; replay "
                           "never writes over the original run: choose an --out outside it")
    check_out(out_storage, overwrite)
    chosen = parse_steps(steps, saved_steps(source_storage))
    check_policy_weights(config, source_storage, chosen)
    return ReplayPlan(source, config, source_storage, out_storage, chosen)


def check_source(run: str | None, traces: str | None) -> None:
    """A replay reads a run (`--run`) or a records file (`--traces`): exactly one of them."""
    if run is not None and traces is not None:
        raise RefusedError("replay: --run and --traces both name traces to replay; give one of them")
    if run is None and traces is None:
        raise RefusedError("replay: name the traces to replay: --run RUN (a run's saved traces) or --traces FILE "
                           "(verifiers trace records)")


def check_records_replay(traces: str, algorithms: list[AlgorithmConfig], out: str, steps: str | None = None,
                         overwrite: bool = False, storage_options: dict[str, Any] | None = None,
                         overrides: list[str] = ()) -> ReplayPlan:
    """`check_replay` for a file of verifiers v1 trace records: the file read whole (RecordsError, one line, for
    one that is not records or holds records without token ids), `--out` as for a run, and the algorithms, which
    may not score with the policy: records do not carry the weights they were sampled with."""
    from trace_rl.verifiers.records import read_records

    out_storage = RunStorage.from_url(out, storage_options)
    check_out(out_storage, overwrite)
    recorded = read_records(traces, storage_options)
    chosen = parse_steps(steps, sorted(recorded), source=f"--traces {traces}")
    envs = list(dict.fromkeys(trace.env for step in chosen for trace in recorded[step]))
    # the records were sampled as far behind their steps as they were: replay neither refuses a record as stale nor
    # masks a token of one continued across steps (its age bound, 2 * lag, is at least every token's age)
    lag = max((int(token_ages(trace, step).max(initial=step - 1 - trace.policy_step))
               for step in chosen for trace in recorded[step]), default=0)
    data: dict[str, Any] = {"name": out_storage.name, "storage": out_storage.storage,
                            "storage_options": storage_options or {}, "env": [{"id": env} for env in envs],
                            "algorithms": [a.model_dump() for a in algorithms],
                            "async": {"max_off_policy_steps": max(lag, 0)}}
    for assignment in overrides:
        apply_override(data, assignment)
    config = validate_config(data, envs=False)
    for job in algorithm_jobs(config):
        cls = resolve_algorithm_class(job.config.id)
        if job.server is None and POLICY in cls.models_used(validate_options(cls, job.config)):
            raise RefusedError(f"--algorithms: {job.config.id!r} scores with the weights that sampled each step, "
                               f"which trace records do not carry; replay a run (--run) for it, or score with "
                               "another model (e.g. opd with model = \"reference\" and --set models.reference.name=...)")
    return ReplayPlan(config, config, out_storage, out_storage, chosen, {step: recorded[step] for step in chosen})


def check_out(out: RunStorage, overwrite: bool) -> None:
    """Without `--overwrite`, `--out` must be empty (its batches and checkpoints would mix with the new ones);
    with it, one that `check_wipe` lets be wiped."""
    if not overwrite and out.exists(out.root) and out.fs.ls(out.root, detail=False):
        raise RefusedError(f"--out {out.url} is not empty; choose a new directory or pass --overwrite to wipe it")
    if overwrite:
        check_wipe(out, "--overwrite")


def stage_records(plan: ReplayPlan) -> None:
    """A records replay's traces as each chosen step's `traces.parquet` under `--out`, where the steps read them."""
    for step, traces in (plan.records or {}).items():
        write_traces(plan.out, step, traces)


def check_policy_weights(config: Config, source: RunStorage, steps: list[int]) -> None:
    """An algorithm that scores with the policy (opsd, opd with `model = "policy"`) needs, at each replayed step,
    the weights that step sampled with; every other algorithm replays without any weights or engine. Refused
    before anything starts when `[ckpt]` pruned some of them."""
    lag = config.async_.max_off_policy_steps
    kept = set(source.stable_steps("weights"))
    has_weights = [s for s in saved_steps(source) if sampling_weights(s, lag) == 0 or sampling_weights(s, lag) in kept]
    for job in algorithm_jobs(config):
        cls = resolve_algorithm_class(job.config.id)
        if job.server is not None or POLICY not in cls.models_used(validate_options(cls, job.config)):
            continue
        missing = sorted({sampling_weights(s, lag) for s in steps} - kept - {0})
        if missing:
            within = f"--steps within {step_ranges(has_weights)}" if has_weights else "another run"
            raise RefusedError(
                f"--algorithms: {job.config.id!r} scores with the policy's weights each step sampled with, but "
                f"the weights of {steps_phrase(missing)} were pruned ([ckpt] keep = {config.ckpt.keep}, "
                f"keep_weights_every = {config.ckpt.keep_weights_every}); the run has the weights of "
                f"{steps_phrase(sorted(kept))}: replay {within}, or keep every step's weights in new runs with "
                "[ckpt] keep_weights_every = 1")


def steps_phrase(steps: list[int]) -> str:
    return "no step" if not steps else f"step {steps[0]}" if len(steps) == 1 else f"steps {step_ranges(steps)}"


def step_ranges(steps: list[int]) -> str:
    """`[1, 2, 3, 5]` as `1:3, 5` (the form --steps takes)."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}:{b}" if a != b else str(a) for a, b in spans)


def check_train_start(source: Config, source_storage: RunStorage, train: bool, from_step: int | None,
                      model: str | None, records: bool = False) -> None:
    """`--from-step` and `--model` only with `--train`. `--from-step K` trains on from the run's `weights/<K>/`,
    which must still be there and be full weights: a LoRA run's are an adapter, so it is refused with the way to
    get a model from them. A replay of `records` has no weights: no `--from-step`."""
    if not train and (from_step is not None or model is not None):
        flag = "--from-step" if from_step is not None else "--model"
        raise RefusedError(f"{flag} says which model --train starts from, but --train is not given; add --train "
                           f"or drop {flag}")
    if from_step is None:
        return
    if records:
        raise RefusedError(f"--from-step {from_step} starts from a run's weights, but --traces replays records, "
                           "which carry none; pass --model NAME (the model whose tokenizer made their token ids)")
    if source.model.lora is not None:
        raise RefusedError(
            f"--from-step {from_step}: the run trains LoRA adapters, so its weights of step {from_step} are an "
            f"adapter, not a model to start from; export them merged (trace-rl export RUN --step {from_step} "
            "--merged DIR) and pass --model DIR")
    kept = source_storage.stable_steps("weights")
    if from_step != 0 and from_step not in kept:
        raise RefusedError(f"--from-step {from_step}: the run has no weights of step {from_step} (pruned by "
                           f"[ckpt], or never written); it has the weights of {steps_phrase(kept)}: pick one of "
                           "them, or --model NAME")


def prepare_out(out: RunStorage) -> None:
    """Wipe `--out` (checked by `check_replay`; only `--overwrite` lets a non-empty one through)."""
    if out.exists(out.root):
        out.remove(out.root)


def parse_steps(text: str | None, available: list[int], source: str = "the run") -> list[int]:
    """`3:7` means steps 3 through 7 (inclusive); `5` one step; None every saved step of `source`."""
    if text is None:
        return available
    first, _, last = text.partition(":")
    try:
        lo = int(first) if first else min(available, default=1)
        hi = int(last) if last else (lo if ":" not in text else max(available, default=lo))
    except ValueError:
        raise ConfigError([f"--steps {text!r}: use FIRST:LAST (inclusive), e.g. --steps 3:7"]) from None
    wanted = [s for s in available if lo <= s <= hi]
    missing = sorted(set(range(lo, hi + 1)) - set(available))
    if missing:
        raise ConfigError([f"--steps {text}: {source} has no saved traces for steps {missing}"])
    return wanted


def source_config(run_url: str, storage_options: dict[str, Any] | None = None, overrides: list[str] = (),
                  flag: str = "--run") -> Config:
    """The config a run was started with, pointed at where the run is now, with `--set` overrides applied."""
    storage = RunStorage.from_url(run_url, storage_options)
    path = storage.path("config.toml")
    if not storage.exists(path):
        raise ConfigError([f"{flag} {run_url}: no config.toml there; is it a trace-rl run directory?"])
    check_run_version(storage, flag)
    local = tomllib.loads(storage.read_bytes(path).decode())
    for assignment in overrides:
        apply_override(local, assignment)
    local["storage"], local["name"] = run_url.rstrip("/").rpartition("/")[::2]
    local["storage"] = local["storage"] or "."
    if storage_options:
        local["storage_options"] = storage_options
    return validate_config(local)


def replay_config(config: Config, algorithms: list[AlgorithmConfig]) -> Config:
    """The source config with `algorithms` as the list of every env."""
    data = config.model_dump(mode="json")
    data["storage_options"] = config.storage_options  # the JSON form leaves credentials out
    data["algorithms"] = [a.model_dump() for a in algorithms]
    for env in data["env"]:
        env["algorithms"] = None
    return validate_config(data)


def saved_steps(storage: RunStorage) -> list[int]:
    base = storage.path("steps")
    if not storage.exists(base):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(base, detail=False)]
    return sorted(int(n) for n in names if n.isdigit() and storage.exists(storage.step_path(int(n), "traces.parquet")))


def batch_stats(samples: list[TrainingSample]) -> dict[str, float]:
    out: dict[str, float] = {"samples": float(len(samples))}
    for loss in LOSS_NAMES:
        values = np.concatenate([getattr(s, f"{loss}_values")[getattr(s, f"{loss}_mask")] for s in samples] or [[]])
        out[f"{loss}_tokens"] = float(values.size)
        out[f"{loss}_mean"] = float(values.mean()) if values.size else 0.0
    return out


def replay_step(session: Session, out: RunStorage, step: int, jobs: list[AlgorithmJob],
                states: dict[str, dict]) -> dict:
    """Replay one step through the pipeline's own validate, aggregate and write stages, into `out`; `states` carries
    stateful algorithms' state from step to step (updated in place)."""
    traces = read_traces(session.storage, step)
    paths = []
    stats: dict[str, float] = {}
    for job in jobs:
        channels, states[job.key] = run_sync(compute_channels(session, step, job, traces, states.get(job.key, {})))
        paths.append(write_channels(out, channels_path(out, step, job, "parquet"), channels))
        stats.update(channel_stats(channels))
    validate_dimensions(session, step, paths, out)
    write_batch(session, step, aggregate_channels(session, step, paths, out)["aggregated"], out)
    original_path = session.storage.step_path(step, "batch.parquet")
    staged = session.storage.url == out.url  # a records replay: no original batch, only the one just written
    original = batch_stats(read_batch(session.storage, step)) if not staged and session.storage.exists(
        original_path) else {}
    return {"step": step, "channels": stats, "replayed": batch_stats(read_batch(out, step)), "original": original}


def initial_states(session: Session, first_step: int, jobs: list[AlgorithmJob]) -> dict[str, dict]:
    """Stateful algorithms start from the source run's checkpoint before `first_step` when it is still kept."""
    from trace_rl.pipeline.step import previous_algorithm_state

    if first_step - 1 not in session.storage.stable_steps("checkpoints") and first_step > 1:
        return {}
    return {job.key: previous_algorithm_state(session, first_step, job) for job in jobs}


def train_config(config: Config, out: RunStorage, model: str, envs: bool = True) -> Config:
    """A config that trains `model` with the source run's trainer settings, stored under `--out` (`envs=False`: a
    records replay's, whose env ids are not checked)."""
    data = config.model_dump(mode="json")
    data["storage"], data["name"] = out.storage, out.name
    data["storage_options"] = out.storage_options
    if model != data["model"]["name"]:
        data["model"]["revision"] = None  # the source run's revision was of its own model, not of `model`
    data["model"]["name"] = model
    return validate_config(data, envs=envs)
