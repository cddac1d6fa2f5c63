"""The algorithm API: the base class, its options and its errors.

An algorithm receives one group of traces (all rollouts of one example of one env)
and, on each branch it trains, sets `branch.advantages` (float32, one per token) and
`branch.mask` (bool, one per token). The runner turns what it set into a channel
`(algorithm id, loss, values, mask)`; channels of the same loss are summed later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from trace_rl.config import AlgorithmConfig
from trace_rl.data.trace import Trace
from trace_rl.names import Loss
from trace_rl.options import NoOptions, option_problems


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
