"""Imports every builtin algorithm module so that each registers its id."""

from trace_rl.algorithms import distill, echo, rae, reward, sft  # noqa: F401
