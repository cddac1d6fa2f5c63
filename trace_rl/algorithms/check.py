"""Config-time checks of every env's algorithm list (run by `trace_rl.loading.check_config`)."""

from __future__ import annotations

from trace_rl.algorithms.base import REGISTRY, AlgorithmError, resolve_algorithm_class, validate_options
from trace_rl.config import Config
from trace_rl.names import POLICY


def check_algorithms(config: Config) -> list[str]:
    """One message per problem; algorithms unknown here go to the env's server when it has one."""
    problems: list[str] = []
    for index, env in enumerate(config.env):
        where = f"env.{index}.algorithms" if env.algorithms is not None else "algorithms"
        for algo in config.algorithms_for(env):
            try:
                cls = resolve_algorithm_class(algo.id)
            except AlgorithmError as exc:
                problems.append(f"{where}: {exc}")
                continue
            if cls is None:
                if env.server is None:
                    problems.append(
                        f"{where}: unknown algorithm {algo.id!r} for env {env.id!r}; builtin ids: "
                        f"{', '.join(sorted(REGISTRY))}; or an import path 'package.module:ClassName'; "
                        "or set env.server to run env-owned algorithms remotely"
                    )
                continue
            try:
                options = validate_options(cls, algo)
            except AlgorithmError as exc:
                problems.append(f"{where}: {exc}")
                continue
            if cls.loss == "rl" and config.actor != POLICY:
                problems.append(
                    f"{where}: {algo.id!r} has loss 'rl', which needs the policy's own logprobs, but "
                    f"actor = {config.actor!r}; use actor = 'policy' or a 'ce' algorithm such as 'sft'"
                )
            problems += [f"{where}: {algo.id!r}: {p}" for p in cls.check_config(options, config)]
    return problems
