"""Environments: examples, rollouts with a sampler, scored traces (see docs/envs.md)."""

from trace_rl.envs.base import EnvError, Environment, Example, Sampler, derive_seed
from trace_rl.envs.lookup import load_env, resolve_env_class
from trace_rl.envs.registry import ENVIRONMENTS, register_env

__all__ = [
    "ENVIRONMENTS", "EnvError", "Environment", "Example", "Sampler", "derive_seed", "load_env", "register_env",
    "resolve_env_class",
]
