"""A policy loss of your own: TOPR, registered as "topr" when the config's `imports` lists this module."""

import torch
from pydantic import BaseModel, ConfigDict, Field

from trace_rl import PolicyLoss, PolicyTokens, register_loss


class TOPROptions(BaseModel):
    """`[trainer.loss.topr]`."""

    model_config = ConfigDict(extra="forbid")
    negative_cap: float = Field(1.0, gt=0, description="the cap of the ratio of a token with A < 0")


@register_loss("topr", TOPROptions)
def topr(tokens: PolicyTokens, options: TOPROptions) -> PolicyLoss:
    """Tapered off-policy REINFORCE (Le Roux et al. 2025, arXiv 2503.14286), with the token's ratio:

        l_t = -A_t lp_t                               where A_t >= 0
        l_t = -sg(min(r_t, negative_cap)) A_t lp_t    where A_t < 0
    """
    negative = tokens.advantages < 0
    r = tokens.log_r.detach().exp()
    weight = torch.where(negative, r.clamp(max=options.negative_cap), torch.ones_like(r))
    return PolicyLoss(-weight * tokens.advantages * tokens.lp, clipped=negative & (r > options.negative_cap))
