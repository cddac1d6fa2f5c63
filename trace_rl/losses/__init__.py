"""Policy losses: the per-token loss of the rl channel, a registry of named functions (docs/trainer.md).

`@register_loss("name", Options)` adds one; `[trainer.loss] policy = "name"` selects it and `[trainer.loss.<name>]`
holds its options. The trainer (`trace_rl.trainer.loss`) gives it the rl tokens of each micro-batch as
`PolicyTokens` and aggregates what it returns.
"""

from trace_rl.losses.lookup import loss_notes, loss_problems, resolve_loss
from trace_rl.losses.registry import LOSSES, LossError, RegisteredLoss, register_loss
from trace_rl.losses.tokens import PolicyLoss, PolicyTokens

__all__ = ["LOSSES", "LossError", "PolicyLoss", "PolicyTokens", "RegisteredLoss", "loss_notes", "loss_problems",
           "register_loss", "resolve_loss"]
