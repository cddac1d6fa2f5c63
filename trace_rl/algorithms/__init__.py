"""Trace algorithms: per-token training signal from rewards and models."""

from trace_rl.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmError
from trace_rl.algorithms.lookup import load_algorithm
from trace_rl.algorithms.registry import ALGORITHMS, register_algorithm

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfig", "AlgorithmError", "load_algorithm", "register_algorithm"]
