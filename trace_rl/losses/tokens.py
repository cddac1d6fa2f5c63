"""What a policy loss is given and what it returns: the rl tokens of one packed micro-batch (`PolicyTokens`) and
their losses with the flags the trainer logs (`PolicyLoss`).

Every tensor is 1-D and aligned with the micro-batch's packed tokens. Tensors are used through their own methods
only, so the loss registry and the builtin losses import without torch: a config check (`--dry-run`) validates a
loss's options without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def per_sequence(values: Tensor, index: Tensor, count: int) -> Tensor:
    """`s_i = sum_{t in sequence i} values_t`, one per sequence (differentiable); `index`: each token's sequence."""
    return values.new_zeros(count).index_add(0, index, values)


def sequence_mean(values: Tensor, mask: Tensor, index: Tensor, count: int) -> Tensor:
    """Each token's `mean_{u in seq(t), u in mask} values_u` (0 for a sequence without a token in `mask`)."""
    total = per_sequence(values.where(mask, 0.0), index, count)
    return (total / per_sequence(mask.to(values.dtype), index, count).clamp(min=1))[index]


@dataclass(frozen=True)
class PolicyTokens:
    """The rl tokens of one micro-batch as a policy loss sees them (docs/trainer.md, "A loss of your own").

    Outside `mask` every value is a placeholder: the trainer sets the loss of those tokens to 0 whatever the
    policy returns there. The gradient reaches the model through `lp` (and `log_r` and `ratio`, made from it)."""

    lp: Tensor  # float: the trainer's logprob of each token
    lp_inf: Tensor  # float, constant: the sampler's logprob of each token
    advantages: Tensor  # float, constant: the rl channel's values A_t
    mask: Tensor  # bool: the tokens of the policy loss: the rl channel's, less those a masking correction dropped
    log_r: Tensor  # float: log r_t = lp_t - lp_inf_t on `mask`, 0 elsewhere (so exp(log_r) is finite everywhere)
    # float: the importance ratio at the correction's level, value w~ and gradient w~ ∇lp: w~ = r_t without a
    # correction, the correction's weight w otherwise, min(w, high) when it truncates
    ratio: Tensor
    weight: Tensor | None  # float, constant: the correction's weight w~ (the value of `ratio`); None: no correction
    sequence: Tensor  # long: each token's sequence in the micro-batch (0, 0, 1, 1, 1, ...)
    sequences: int  # how many sequences the micro-batch holds

    def sequence_mean(self, values: Tensor) -> Tensor:
        """Each token's mean of `values` over the `mask` tokens of its sequence (0 for a sequence without any)."""
        return sequence_mean(values, self.mask, self.sequence, self.sequences)


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss's result: one loss per token and, optionally, which tokens it clipped or dropped (bool, one
    per token), logged as fractions of the step's rl tokens (`clipped_fraction`, `trust_region_masked`).

    A loss function may return the per-token tensor alone: no token clipped or dropped."""

    loss: Tensor  # float, one per token: l_t
    clipped: Tensor | None = None  # bool: the policy's clip (or gate) took the token's gradient; None: no token
    dropped: Tensor | None = None  # bool: the policy's trust region dropped the token from its term; None: no token
