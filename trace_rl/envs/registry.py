"""The registry of environment ids: `@register_env("id")` adds a class under an id (and sets its `id`); the builtins register theirs
when `trace_rl.envs.lookup` imports them, a plugin when its module is imported."""

from __future__ import annotations

from trace_rl.envs.base import EnvError, Environment


ENVIRONMENTS: dict[str, type[Environment]] = {}


def register_env(env_id: str):
    """Class decorator adding an environment to the registry under `env_id`, which becomes its `id`."""

    def add(cls: type[Environment]) -> type[Environment]:
        if ENVIRONMENTS.get(env_id, cls) is not cls:
            raise EnvError(f"environment id {env_id!r} is already registered")
        cls.id = env_id
        ENVIRONMENTS[env_id] = cls
        return cls

    return add
