"""Loading a run's config: TOML and `--set` overrides into a `Config`, then every check that needs more
than the schema: env ids and args, each env's algorithms and their options, model names (Hub ids in
the cache when offline), stop tokens, tracker backends and LoRA targets. All problems are reported together in one
ConfigError.

Everything that starts a run goes through here (the CLI, `prepare_run` for runs started from
the Prefect UI, replay), so a bad config fails before any flow run or model load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_rl.algorithms.check import check_algorithms
from trace_rl.colocation import check_colocation
from trace_rl.config import Config, ConfigError, parse_config, read_config_data
from trace_rl.envs.base import check_envs
from trace_rl.hub import check_models
from trace_rl.lora import check_lora
from trace_rl.models import check_stop_tokens
from trace_rl.tracking import check_trackers


def check_config(config: Config) -> Config:
    """The config itself if every check passes; else one ConfigError listing each problem with its fix."""
    problems = check_envs(config) + check_algorithms(config) + check_models(config) + check_stop_tokens(config)
    problems += check_trackers(config) + check_lora(config)
    if not problems:  # which engines exist depends on valid algorithm options
        problems = check_colocation(config)
    if problems:
        raise ConfigError(problems)
    return config


def validate_config(data: dict[str, Any]) -> Config:
    """A checked Config from plain data (schema problems first: the checks need a valid config)."""
    return check_config(parse_config(data))


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """A checked Config from a TOML file and `--set` overrides."""
    return validate_config(read_config_data(path, overrides))
