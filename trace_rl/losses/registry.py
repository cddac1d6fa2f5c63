"""The registry of policy losses: `@register_loss("name", Options)` adds a loss function under a name, chosen
with `[trainer.loss] policy = "name"` and given its options from `[trainer.loss.<name>]`. The builtins register
theirs when `trace_rl.losses` is imported, a user's loss when its module (listed in the config's `imports`) is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from trace_rl.config import Aggregation, LossConfig
from trace_rl.options import NoOptions

if TYPE_CHECKING:
    from torch import Tensor

    from trace_rl.losses.tokens import PolicyLoss, PolicyTokens

# fn(tokens, options) -> the loss of each token, alone or as a PolicyLoss with the tokens it clipped or dropped
LossFunction = Callable[["PolicyTokens", Any], "Tensor | PolicyLoss"]


class LossError(ValueError):
    """A policy loss registered wrong, or configured wrong."""


@dataclass(frozen=True)
class RegisteredLoss:
    """A policy loss as registered: its function, its options model and its defaults."""

    name: str  # the `[trainer.loss] policy` that selects it, and its options table `[trainer.loss.<name>]`
    function: LossFunction
    Options: type[BaseModel]  # the model of its options table (extra keys forbidden)
    aggregation: Aggregation  # the aggregation it runs with where `[trainer.loss] aggregation` is unset
    truncatable: bool  # it weighs tokens by the correction's weight, so a truncating correction applies to it


LOSSES: dict[str, RegisteredLoss] = {}


def register_loss(name: str, Options: type[BaseModel] = NoOptions, *, aggregation: Aggregation = "token-mean",
                  truncatable: bool = False) -> Callable[[LossFunction], LossFunction]:
    """Decorator adding the policy loss `fn(tokens: PolicyTokens, options: Options) -> Tensor | PolicyLoss` under
    `name`. `Options` is the pydantic model of `[trainer.loss.<name>]` and must forbid extra keys.
    `aggregation` is the loss's default aggregation. `truncatable`: the loss weighs each token by the importance
    correction's weight (`tokens.ratio` or `tokens.weight`), so `correction.mode = 'truncate'` (and
    `max_is_ratio`) may cap it; otherwise the loss clips or gates its own ratio and only mode = 'mask' applies."""
    if name in LossConfig.model_fields:
        raise LossError(f"loss name {name!r} is a key of [trainer.loss] itself; choose another name")
    if Options.model_config.get("extra") != "forbid":
        raise LossError(f"loss {name!r}: its options model {Options.__name__} must refuse unknown keys: set "
                        "model_config = ConfigDict(extra='forbid')")

    def add(function: LossFunction) -> LossFunction:
        known = LOSSES.get(name)
        if known is not None and _origin(known.function) != _origin(function):  # the same module imported again
            raise LossError(f"loss name {name!r} is already registered by {'.'.join(_origin(known.function))}")
        LOSSES[name] = RegisteredLoss(name, function, Options, aggregation, truncatable)
        return function

    return add


def _origin(function: LossFunction) -> tuple[str, str]:
    return function.__module__, function.__qualname__
