"""The registry of algorithm ids: `@register("id")` adds a class under an id; the builtins register theirs
when `trace_rl.algorithms.lookup` imports them, a plugin when its module is imported."""

from __future__ import annotations

from trace_rl.algorithms.base import Algorithm, AlgorithmError


REGISTRY: dict[str, type[Algorithm]] = {}


def register(algorithm_id: str):
    """Class decorator adding an algorithm to the registry under `algorithm_id`."""

    def add(cls: type[Algorithm]) -> type[Algorithm]:
        if algorithm_id in REGISTRY and REGISTRY[algorithm_id] is not cls:
            raise AlgorithmError(f"algorithm id {algorithm_id!r} is already registered")
        REGISTRY[algorithm_id] = cls
        return cls

    return add
