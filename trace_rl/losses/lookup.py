"""The policy loss a `[trainer.loss]` names, its validated options and defaults, and the config's problems with it.

Importing this module imports the builtin losses, so each has registered its name; a user's loss is registered
once the config's `imports` are (`trace_rl.runs.loading` and the trainer import them first).
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

import trace_rl.losses.builtin  # noqa: F401  (the builtins: importing it registers them)
from trace_rl.config import Aggregation, LossConfig
from trace_rl.losses.registry import LOSSES, LossError, RegisteredLoss
from trace_rl.options import option_problems


def loss_problems(config: LossConfig) -> list[str]:
    """What is wrong with `[trainer.loss]` against the registry, one line each naming the key and the fix: an
    unknown policy, a table that is not the policy's, options its model refuses, and keys that do not fit it."""
    loss = LOSSES.get(config.policy)
    if loss is None:
        return [f"trainer.loss.policy: unknown loss {config.policy!r}; registered: {', '.join(sorted(LOSSES))}, or "
                "register one with @register_loss in a module the config's `imports` lists (docs/trainer.md)"]
    problems = []
    for name in config.tables:
        if name == loss.name:
            continue
        if name in LOSSES:
            problems.append(f"trainer.loss.{name}: the options of policy '{name}', but policy = '{loss.name}'; "
                            f"remove [trainer.loss.{name}] or set policy = '{name}'")
        else:
            known = ", ".join([*LossConfig.model_fields, loss.name])
            problems.append(f"trainer.loss.{name}: unknown key (known keys: {known})")
    try:
        loss.Options(**config.tables.get(loss.name, {}))
    except ValidationError as exc:
        problems += option_problems(exc, loss.Options, f"trainer.loss.{loss.name}.")
    aggregation = config.aggregation or loss.aggregation
    if config.norm_tokens is not None and aggregation != "seq-mean-token-sum-norm":
        problems.append("trainer.loss.norm_tokens: used only by aggregation = 'seq-mean-token-sum-norm'; remove it")
    correction = config.importance_correction
    if correction is not None and correction.mode == "truncate" and not loss.truncatable:
        what = "max_is_ratio" if config.max_is_ratio is not None else "correction.mode = 'truncate'"
        truncatable = ", ".join(name for name, other in sorted(LOSSES.items()) if other.truncatable)
        problems.append(f"trainer.loss.{what.partition(' ')[0]}: {what} truncates the importance weight of "
                        f"{truncatable}; policy = '{loss.name}' has its own clipped or gated ratio: use "
                        "correction.mode = 'mask'")
    return problems


def resolve_loss(config: LossConfig) -> tuple[RegisteredLoss, BaseModel, Aggregation]:
    """The policy loss `config` names, its validated options and the aggregation it runs with; LossError listing
    `loss_problems` where there are any."""
    problems = loss_problems(config)
    if problems:
        raise LossError("; ".join(problems))
    loss = LOSSES[config.policy]
    return loss, loss.Options(**config.tables.get(loss.name, {})), config.aggregation or loss.aggregation


def loss_notes(config: LossConfig) -> list[str]:
    """Warnings about a valid but unusual choice, logged once when a run starts: an aggregation other than the one
    a loss is defined with (a loss that registered a default other than token-mean)."""
    loss = LOSSES.get(config.policy)
    if loss is None or loss.aggregation == "token-mean" or config.aggregation in (None, loss.aggregation):
        return []
    return [f"trainer.loss: policy = '{loss.name}' with aggregation = '{config.aggregation}' (as verl allows); the "
            f"loss is defined per sequence with aggregation = '{loss.aggregation}', its default"]
