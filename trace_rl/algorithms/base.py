"""The algorithm API: configs, the base class and the registry.

An algorithm receives one group of traces (all rollouts of one example of one env)
and, on each branch it trains, sets `branch.advantages` (float32, one per token) and
`branch.mask` (bool, one per token). The runner turns what it set into a channel
`(algorithm id, loss, values, mask)`; channels of the same loss are summed later.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from trace_rl.config import AlgorithmConfig
from trace_rl.data.trace import Trace
from trace_rl.imports import module_is_missing, not_on_path
from trace_rl.names import Loss
from trace_rl.options import option_problems



class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AlgorithmError(ValueError):
    """A bad algorithm config or a group an algorithm cannot handle."""


class Algorithm:
    """Base class. Subclasses set `loss`, optionally `Options`, and implement `advantage`."""

    loss: ClassVar[Loss] = "rl"
    Options: ClassVar[type[BaseModel]] = NoOptions
    # True when a trace's annotations depend on that trace alone: the runner then hands `advantage` every
    # group in one call (one vectorized pass instead of one per group)
    per_trace: ClassVar[bool] = False
    # True when an annotation depends on the whole step (batch-level statistics: grpo's scale = "batch",
    # reinforce_pp): the runner then hands `advantage` every group of the step in one call; it may be a
    # property of the options. On an env server, see docs/algorithms.md
    whole_step: ClassVar[bool] = False

    def __init__(self, config: AlgorithmConfig):
        self.config = config
        self.id = config.id
        self.options = validate_options(type(self), config)

    @classmethod
    def check_config(cls, options: BaseModel, run_config: Any) -> list[str]:
        """Problems with using this algorithm in `run_config` (a trace_rl.config.Config), checked at load time."""
        return []

    @classmethod
    def models_used(cls, options: BaseModel) -> set[str]:
        """Keys of the model runtimes `setup` binds: the engines a run starts for this algorithm. Default: none."""
        return set()

    async def setup(self, models: Mapping[str, Any]) -> None:
        """Bind model runtimes by key: `models` holds those `models_used` names (the policy on the weights the
        step sampled with), and nothing else. Default: none needed."""

    async def advantage(self, traces: list[Trace]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints (e.g. running baselines). Stateless by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise AlgorithmError(f"algorithm {self.id!r} keeps no state but was given {sorted(state)}")


def validate_options(cls: type[Algorithm], config: AlgorithmConfig) -> BaseModel:
    try:
        return cls.Options(**config.options)
    except ValidationError as exc:
        problems = option_problems(exc, cls.Options)
        raise AlgorithmError(f"algorithm {config.id!r}: " + "; ".join(problems)) from None


REGISTRY: dict[str, type[Algorithm]] = {}


def register(algorithm_id: str):
    """Class decorator adding an algorithm to the registry under `algorithm_id`."""

    def add(cls: type[Algorithm]) -> type[Algorithm]:
        if algorithm_id in REGISTRY and REGISTRY[algorithm_id] is not cls:
            raise AlgorithmError(f"algorithm id {algorithm_id!r} is already registered")
        REGISTRY[algorithm_id] = cls
        return cls

    return add


def is_import_path(algorithm_id: str) -> bool:
    return ":" in algorithm_id


def resolve_algorithm_class(algorithm_id: str) -> type[Algorithm] | None:
    """The class for a builtin/registered id or a `package.module:ClassName` path; None if unknown here (no
    such id, or the module itself does not exist: an env server may know it). A module that exists but fails
    to import (a missing dependency, an error inside it), or lacks the class, raises AlgorithmError naming
    the module and the original error: it is never taken for an unknown, remote algorithm."""
    import trace_rl.algorithms.builtins  # noqa: F401  (registers the builtins)

    if algorithm_id in REGISTRY:
        return REGISTRY[algorithm_id]
    if not is_import_path(algorithm_id):
        return None
    module_name, _, attr = algorithm_id.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if module_is_missing(module_name, exc):
            return None  # the module itself is not here
        raise AlgorithmError(f"algorithm {algorithm_id!r}: importing module {module_name!r} failed: "
                             f"{type(exc).__name__}: {exc}; install the missing package or fix the module") from exc
    except Exception as exc:  # an ImportError or any error raised while the module runs
        raise AlgorithmError(f"algorithm {algorithm_id!r}: importing module {module_name!r} failed: "
                             f"{type(exc).__name__}: {exc}; fix the module or install its dependencies") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise AlgorithmError(f"algorithm {algorithm_id!r}: module {module_name!r} has no attribute {attr!r}; "
                             "check the class name after ':'")
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
            f"unknown algorithm {config.id!r}; builtin ids: {', '.join(sorted(REGISTRY))}, "
            "or give an import path 'package.module:ClassName'"
        )
    return cls(config)
