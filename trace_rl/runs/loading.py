"""Loading a run's config: TOML and `--set` overrides into a `Config`, then every check that needs more
than the schema: env ids and args, each env's algorithms and their options, the policy loss and its options,
model names (Hub ids in the cache when offline), stop tokens, tracker backends and LoRA targets. All problems are
reported together in one ConfigError: schema problems with those of the env and algorithm entries that parse on
their own; the checks that need the whole config once the schema passes.

Everything that starts a run goes through here (the CLI, `prepare_run` for runs started from
the Prefect UI, replay), so a bad config fails before any flow run or model load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_rl.algorithms.check import check_algorithm, check_algorithms
from trace_rl.config import AlgorithmConfig, Config, ConfigError, parse_config, read_config_data
from trace_rl.envs.lookup import check_env, check_envs
from trace_rl.imports import import_modules
from trace_rl.losses import loss_problems
from trace_rl.models.hub import check_models
from trace_rl.models.lora import check_lora
from trace_rl.models.runtime import check_stop_tokens
from trace_rl.pipeline.colocation import check_colocation
from trace_rl.pipeline.partial import check_partial
from trace_rl.runs.tracking import check_trackers


def check_config(config: Config, on_this_machine: bool = False, envs: bool = True) -> Config:
    """The config itself if every check passes; else one ConfigError listing each problem with its fix.
    `on_this_machine`: the run starts in this process, so what this machine has counts too (a GPU for
    `inference.colocate`). `envs=False` leaves the env ids unchecked: a replay of trace records names with them
    where its traces came from, not envs it runs."""
    problems = import_modules(config.imports)
    if problems:  # the ids below may be theirs
        raise ConfigError(problems)
    problems = (check_envs(config) if envs else []) + check_algorithms(config) + loss_problems(config.trainer.loss)
    problems += check_models(config)
    problems += check_stop_tokens(config) + check_partial(config)
    problems += check_trackers(config) + check_lora(config)
    if not problems:  # which engines exist depends on valid algorithm options
        problems = check_colocation(config, on_this_machine)
    if problems:
        raise ConfigError(problems)
    return config


def validate_config(data: dict[str, Any], on_this_machine: bool = False, envs: bool = True) -> Config:
    """A checked Config from plain data. When the schema fails, its problems come with those of the env ids
    and args and the algorithm ids and options of the entries that parse on their own; the checks that need
    the whole config (models, stop tokens, trackers, LoRA targets, colocation, an algorithm against the
    actor) run once the schema passes."""
    try:
        config = parse_config(data)
    except ConfigError as exc:
        raise ConfigError(list(dict.fromkeys(exc.problems + (entry_problems(data) if envs else [])))) from None
    return check_config(config, on_this_machine, envs)


def load_config(path: str | Path, overrides: list[str] = (), on_this_machine: bool = False) -> Config:
    """A checked Config from a TOML file and `--set` overrides."""
    return validate_config(read_config_data(path, overrides), on_this_machine)


def entry_problems(data: Any) -> list[str]:
    """For config data whose schema failed: the problems of each `[[env]]` and `[[eval.envs]]` entry's id and
    args, and of each env's algorithms' ids and options, for the entries whose own keys are well-formed."""
    if not isinstance(data, dict):
        return []
    imports = data.get("imports")
    if isinstance(imports, list) and all(isinstance(name, str) for name in imports):
        failed = import_modules(imports)
        if failed:
            return failed
    envs = [(f"env.{i}", entry) for i, entry in enumerate(_list(data.get("env")))]
    evaluation = data.get("eval")
    if isinstance(evaluation, dict):
        envs += [(f"eval.envs.{i}", entry) for i, entry in enumerate(_list(evaluation.get("envs")))]
    problems = []
    for where, entry in envs:
        paths = entry.get("import_paths", []) if isinstance(entry, dict) else None
        if (isinstance(entry, dict) and isinstance(entry.get("id"), str) and isinstance(entry.get("args", {}), dict)
                and isinstance(paths, list) and all(isinstance(path, str) for path in paths)):
            select = entry.get("select") if isinstance(entry.get("select"), dict) else None
            problems += check_env(where, entry["id"], entry.get("args", {}), paths, select=select)
    default = data.get("algorithms", Config.model_fields["algorithms"].get_default(call_default_factory=True))
    for index, entry in enumerate(_list(data.get("env"))):
        if not isinstance(entry, dict):
            continue
        own = entry.get("algorithms")
        server = entry.get("server")
        for spec in _list(own if own is not None else default):
            try:
                algo = AlgorithmConfig.parse(spec)
            except (TypeError, ValueError):  # a schema problem, reported as such
                continue
            problems += check_algorithm(f"env.{index}.algorithms" if own is not None else "algorithms", algo,
                                        str(entry.get("id")), server if isinstance(server, str) else None)
    return problems


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []
