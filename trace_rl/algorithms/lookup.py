"""Finding an algorithm by id: a builtin or registered id, or an import path `package.module:ClassName`.

Importing this module imports every builtin algorithm, so each has registered its ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the builtins: importing each registers its ids
import trace_rl.algorithms.distill  # noqa: F401
import trace_rl.algorithms.echo  # noqa: F401
import trace_rl.algorithms.hierarchical  # noqa: F401
import trace_rl.algorithms.rae  # noqa: F401
import trace_rl.algorithms.reward  # noqa: F401
import trace_rl.algorithms.sft  # noqa: F401
from trace_rl.algorithms.base import Algorithm, AlgorithmError
from trace_rl.algorithms.registry import ALGORITHMS
from trace_rl.config import AlgorithmConfig
from trace_rl.imports import ImportPathError, import_path, not_on_path


def is_import_path(algorithm_id: str) -> bool:
    return ":" in algorithm_id


def resolve_algorithm_class(algorithm_id: str) -> type[Algorithm] | None:
    """The class for a builtin/registered id or a `package.module:ClassName` path; None if unknown here (no
    such id, or the module itself does not exist: an env server may know it). A module that exists but fails
    to import (a missing dependency, an error inside it), or lacks the class, raises AlgorithmError naming
    the module and the original error: it is never taken for an unknown, remote algorithm."""
    if algorithm_id in ALGORITHMS:
        return ALGORITHMS[algorithm_id]
    if not is_import_path(algorithm_id):
        return None
    try:
        cls = import_path(algorithm_id, "algorithm")
    except ImportPathError as exc:
        if exc.missing_module:
            return None  # the module itself is not here
        raise AlgorithmError(str(exc)) from exc.__cause__
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise AlgorithmError(f"{algorithm_id!r} is not a trace_rl Algorithm subclass")
    return cls


def load_algorithm(spec: str | Mapping[str, Any] | AlgorithmConfig) -> Algorithm:
    config = AlgorithmConfig.parse(spec)
    cls = resolve_algorithm_class(config.id)
    if cls is None and is_import_path(config.id):
        raise AlgorithmError(f"algorithm {config.id!r}: {not_on_path(config.id.partition(':')[0])}")
    if cls is None:
        raise AlgorithmError(
            f"unknown algorithm {config.id!r}; builtin ids: {', '.join(sorted(ALGORITHMS))}, "
            "or give an import path 'package.module:ClassName'"
        )
    return cls(config)
