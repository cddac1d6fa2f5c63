"""The registry of environment ids: `@register_env` adds a class under its `id`; the builtins register theirs
when `trace_rl.envs.lookup` imports them, a plugin when its module is imported."""

from __future__ import annotations

from trace_rl.envs.base import EnvError, Environment


ENVIRONMENTS: dict[str, type[Environment]] = {}


def register_env(cls: type[Environment]) -> type[Environment]:
    """Class decorator adding an environment to the registry under its `id`."""
    if not cls.id:
        raise EnvError(f"{cls.__name__} needs a class attribute `id` to be registered")
    if ENVIRONMENTS.get(cls.id, cls) is not cls:
        raise EnvError(f"environment id {cls.id!r} is already registered")
    ENVIRONMENTS[cls.id] = cls
    return cls
