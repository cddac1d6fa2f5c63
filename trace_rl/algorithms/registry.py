"""The registry of algorithm ids: `@register_algorithm("id")` adds a class under an id; the builtins register theirs
when `trace_rl.algorithms.lookup` imports them, a plugin when its module is imported."""

from __future__ import annotations

from trace_rl.algorithms.base import Algorithm, AlgorithmError


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(algorithm_id: str):
    """Class decorator adding an algorithm to the registry under `algorithm_id`."""

    def add(cls: type[Algorithm]) -> type[Algorithm]:
        if algorithm_id in ALGORITHMS and ALGORITHMS[algorithm_id] is not cls:
            raise AlgorithmError(f"algorithm id {algorithm_id!r} is already registered")
        ALGORITHMS[algorithm_id] = cls
        return cls

    return add
