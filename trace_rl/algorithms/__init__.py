"""Trace algorithms: per-token training signal from rewards and models."""

from trace_rl.algorithms.base import (
    REGISTRY,
    Algorithm,
    AlgorithmConfig,
    AlgorithmError,
    load_algorithm,
    register,
)

__all__ = ["REGISTRY", "Algorithm", "AlgorithmConfig", "AlgorithmError", "load_algorithm", "register"]
