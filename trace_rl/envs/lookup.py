"""Finding an environment by id: a builtin or registered id, or an import path `package.module:ClassName`;
and the config-time checks of a run's envs.

Importing this module imports every builtin environment, so each has registered its id.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

# the builtins: importing each registers its id
import trace_rl.envs.alphabet_sort  # noqa: F401
import trace_rl.envs.dataset  # noqa: F401
import trace_rl.envs.gym  # noqa: F401
import trace_rl.envs.link_nav  # noqa: F401
import trace_rl.envs.number_debate  # noqa: F401
import trace_rl.envs.reverse_text  # noqa: F401
import trace_rl.envs.secret_lookup  # noqa: F401
import trace_rl.envs.verifiers_env  # noqa: F401
from trace_rl.envs.base import EnvError, Environment, import_named, validate_args
from trace_rl.envs.registry import ENVIRONMENTS
from trace_rl.envs.verifiers_env import VerifiersEnv
from trace_rl.envs.verifiers_remote import VerifiersRemoteEnv


def resolve_env_class(env_id: str) -> type[Environment]:
    """The class for a registered id or a `package.module:ClassName` import path."""
    if env_id in ENVIRONMENTS:
        return ENVIRONMENTS[env_id]
    if ":" not in env_id:
        known = ", ".join(sorted(ENVIRONMENTS))
        raise EnvError(f"unknown env id {env_id!r}; use a builtin ({known}) or an import path 'package.module:Class'")
    cls = import_named(env_id, "env")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvError(f"env {env_id!r} is not a trace_rl Environment subclass")
    return cls


def add_import_paths(paths: Sequence[str]) -> None:
    """Put an env's `import_paths` at the front of sys.path and of PYTHONPATH (once each), so the modules they hold
    import by name here and in the processes started from here (a verifiers env's tool servers)."""
    for path in reversed(paths):
        folder = os.path.abspath(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if folder not in inherited:
            os.environ["PYTHONPATH"] = os.pathsep.join([folder, *inherited])


def load_env(env_id: str, args: Mapping[str, Any] | None = None, import_paths: Sequence[str] = (),
             verifiers_server: str | None = None, select: Mapping[str, Any] | None = None) -> Environment:
    """The env; with `verifiers_server` (an `EnvConfig.verifiers_server`) the verifiers env played on it; `select`
    (`EnvConfig.select`, a verifiers env's only) the tasks it picks."""
    add_import_paths(import_paths)
    if verifiers_server is not None:
        return VerifiersRemoteEnv(args, dict(select) if select is not None else None, server=verifiers_server)
    if select is not None:
        return VerifiersEnv(args, dict(select))
    return resolve_env_class(env_id)(args)


def check_envs(config) -> list[str]:
    """Config-time check of every `[[env]]` and `[[eval.envs]]` (run by `trace_rl.runs.loading.check_config`): a known
    id, valid `args` and whatever else the env checks (`Environment.check_config`)."""
    where = [(f"env.{i}", env) for i, env in enumerate(config.env)]
    if config.eval is not None:
        where += [(f"eval.envs.{i}", env) for i, env in enumerate(config.eval.envs)]
    problems = []
    for name, env in where:
        problems += check_env(name, env.id, env.args, env.import_paths, env.verifiers_server, env.select)
    return problems


def check_env(where: str, env_id: str, args: Mapping[str, Any], import_paths: Sequence[str] = (),
              verifiers_server: str | None = None, select: Mapping[str, Any] | None = None) -> list[str]:
    """The problems of one env entry: existing `import_paths`, a known id and valid `args` (also run on the entries
    of a config whose schema failed, `trace_rl.runs.loading`); with `verifiers_server`, as the env it plays; with
    `select`, the tasks it picks (a verifiers env's)."""
    missing = [path for path in import_paths if not os.path.isdir(path)]
    if missing:
        return [f"{where}.import_paths: {missing[0]!r} is not a folder (relative to the working directory "
                f"{os.getcwd()}); fix the path or run trace-rl from the folder it is relative to"]
    add_import_paths(import_paths)
    try:
        cls = VerifiersRemoteEnv if verifiers_server is not None else resolve_env_class(env_id)
        options = validate_args(cls, dict(args))
        if select is not None and issubclass(cls, VerifiersEnv):
            problems = cls.selection_problems(options.model_dump(), dict(select))
        else:
            problems = cls.check_config(options)
    except EnvError as exc:
        return [f"{where}: {exc}"]
    return [f"{where}: {problem}" for problem in problems]
