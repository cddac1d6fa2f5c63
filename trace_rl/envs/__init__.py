"""Environments: examples, rollouts with a sampler, scored traces (see docs/envs.md)."""

from trace_rl.envs.base import (
    ENVIRONMENTS,
    EnvError,
    Environment,
    Example,
    Sampler,
    derive_seed,
    load_env,
    register_env,
    resolve_env_class,
)

__all__ = [
    "ENVIRONMENTS", "EnvError", "Environment", "Example", "Sampler", "derive_seed", "load_env", "register_env",
    "resolve_env_class",
]
