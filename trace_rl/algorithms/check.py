"""Config-time checks of every env's algorithm list (run by `trace_rl.runs.loading.check_config`)."""

from __future__ import annotations

from trace_rl.algorithms.base import AlgorithmError, validate_options
from trace_rl.algorithms.lookup import is_import_path, resolve_algorithm_class
from trace_rl.algorithms.registry import ALGORITHMS
from trace_rl.config import AlgorithmConfig, Config
from trace_rl.imports import not_on_path
from trace_rl.names import POLICY


def check_algorithms(config: Config) -> list[str]:
    """One message per problem; algorithms unknown here go to the env's server when it has one."""
    problems: list[str] = []
    for index, env in enumerate(config.env):
        where = f"env.{index}.algorithms" if env.algorithms is not None else "algorithms"
        for algo in config.algorithms_for(env):
            problems += check_algorithm(where, algo, env.id, env.algorithm_server, config)
    return list(dict.fromkeys(problems))


def check_algorithm(where: str, algo: AlgorithmConfig, env_id: str, server: str | None,
                    config: Config | None = None) -> list[str]:
    """The problems of one algorithm of the env `env_id`: its id and options, and, given the whole `config`,
    whether it fits the run (its loss and the actor, `Algorithm.check_config`). Without `config` (a config
    whose schema failed: `trace_rl.runs.loading`) only the id and the options are checked."""
    try:
        cls = resolve_algorithm_class(algo.id)
    except AlgorithmError as exc:
        return [f"{where}: {exc}"]
    if cls is None:
        if server is not None:
            return []  # the env's server runs it
        if is_import_path(algo.id):
            return [f"{where}: algorithm {algo.id!r}: {not_on_path(algo.id.partition(':')[0])}; or set env.server "
                    "to run it on an env server"]
        return [f"{where}: unknown algorithm {algo.id!r} for env {env_id!r}; builtin ids: "
                f"{', '.join(sorted(ALGORITHMS))}; or an import path 'package.module:ClassName'; "
                "or set env.server to run env-owned algorithms remotely"]
    try:
        options = validate_options(cls, algo)
    except AlgorithmError as exc:
        return [f"{where}: {exc}"]
    if config is None:
        return []
    problems = []
    if cls.loss == "rl" and config.actor != POLICY:
        problems.append(
            f"{where}: {algo.id!r} has loss 'rl', which needs the policy's own logprobs, but "
            f"actor = {config.actor!r}; use actor = 'policy' or a 'ce' algorithm such as 'sft'"
        )
    return problems + [f"{where}: {algo.id!r}: {p}" for p in cls.check_config(options, config)]
