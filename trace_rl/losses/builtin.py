"""The builtin policy losses, one function each: the loss of each rl token (docs/trainer.md, "The rl policy
loss").

Per token: `lp` the trainer's logprob, `lp_inf` the sampler's, `log_r = lp - lp_inf`, `r = exp(log_r)`, `A` the
advantage; `sg` is stop-gradient. With one optimizer step per batch the behaviour policy is the sampler, so `r` is
the trainer's ratio to the sampler (verl's bypass mode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from trace_rl.losses.registry import register_loss
from trace_rl.losses.tokens import PolicyLoss

if TYPE_CHECKING:
    from torch import Tensor

    from trace_rl.losses.tokens import PolicyTokens
    from trace_rl.options import NoOptions


class DPPOOptions(BaseModel):
    """`[trainer.loss.dppo]`."""

    model_config = ConfigDict(extra="forbid")
    mask_low: float = Field(0.2, ge=0, description="the trust region below: drop A < 0 tokens whose probability "
                            "fell by more than this")
    mask_high: float = Field(0.2, ge=0, description="the trust region above: drop A > 0 tokens whose probability "
                             "rose by more than this")
    kl_tau: float = Field(1e-3, ge=0, description="weight of the log-ratio**2 penalty on rl tokens")


@register_loss("dppo", DPPOOptions, truncatable=True)
def dppo(tokens: PolicyTokens, options: DPPOOptions) -> PolicyLoss:
    """DPPO (prime-rl): importance-weighted policy gradient with a trust-region mask and a squared-log-ratio KL.

        dp_t = exp(lp_t) - exp(lp_inf_t)
        keep_t = 0 where A_t > 0 and dp_t > mask_high, or A_t < 0 and dp_t < -mask_low (else 1)
        l_t = -keep_t * A_t * r~_t + kl_tau * log_r_t**2
        d l_t / d lp_t = -keep_t * A_t * w~_t + 2 * kl_tau * log_r_t

    `r~` is `tokens.ratio`: r without a correction, min(r, C) with max_is_ratio = C.
    """
    a = tokens.advantages
    dp = tokens.lp.detach().exp() - tokens.lp_inf.exp()
    dropped = ((a > 0) & (dp > options.mask_high)) | ((a < 0) & (dp < -options.mask_low))
    policy = (a * tokens.ratio).where(~dropped, 0.0)
    return PolicyLoss(-policy + options.kl_tau * tokens.log_r**2, dropped=dropped)


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
                      clip_c: float | None = None) -> PolicyLoss:
    """PPO's clipped surrogate with separate bounds (DAPO's clip-higher) and the optional dual clip.

        l_t = max(-r_t A_t, -clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
        dual clip (clip_c, Ye et al. 2020), where A_t < 0:  l_t = min(l_t, -clip_c A_t)

    Schulman et al. 2017; Yu et al. 2025 (DAPO). Clipped: the tokens whose clipped branch is the one taken.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = unclipped.maximum(clipped)
    taken = clipped > unclipped
    if clip_c is not None:
        floor = -clip_c * advantages
        dual = (advantages < 0) & (loss > floor)
        loss = floor.where(dual, loss)
        taken = taken | dual
    return PolicyLoss(loss, clipped=taken)


class PPOOptions(BaseModel):
    """`[trainer.loss.ppo]`."""

    model_config = ConfigDict(extra="forbid")
    clip_low: float = Field(0.2, ge=0, description="the ratio's lower clip 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="the ratio's upper clip 1 + clip_high (DAPO's clip-higher: "
                             "above clip_low)")
    clip_c: float | None = Field(None, gt=1, description="dual clip: a token with A < 0 loses at most -clip_c * A "
                                 "(unset: no dual clip)")


@register_loss("ppo", PPOOptions)
def ppo(tokens: PolicyTokens, options: PPOOptions) -> PolicyLoss:
    """PPO: `clipped_surrogate` of the token ratio r_t = exp(lp_t - lp_inf_t) (the sampler is the behaviour
    policy). Schulman et al. 2017."""
    return clipped_surrogate(tokens.log_r.exp(), tokens.advantages, options.clip_low, options.clip_high,
                             options.clip_c)


class GSPOOptions(BaseModel):
    """`[trainer.loss.gspo]`: the paper's clip range by default (Zheng et al. 2025, section 5.1)."""

    model_config = ConfigDict(extra="forbid")
    clip_low: float = Field(3e-4, ge=0, description="the sequence ratio's lower clip 1 - clip_low")
    clip_high: float = Field(4e-4, ge=0, description="the sequence ratio's upper clip 1 + clip_high")


@register_loss("gspo", GSPOOptions, aggregation="seq-mean-token-mean")
def gspo(tokens: PolicyTokens, options: GSPOOptions) -> PolicyLoss:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the clipped surrogate of the sequence ratio.

        s_i = exp(mean_{t in seq i, t in mask} log_r_t)
        s_it = sg(s_i) * exp(log_r_t - sg(log_r_t))        (value s_i, gradient s_i ∇lp_t)
        l_t = max(-s_it A_t, -clip(s_it, 1 - clip_low, 1 + clip_high) A_t)
    """
    log_r = tokens.log_r
    ratio = (tokens.sequence_mean(log_r.detach()) + log_r - log_r.detach()).exp()
    return clipped_surrogate(ratio, tokens.advantages, options.clip_low, options.clip_high)


class CISPOOptions(BaseModel):
    """`[trainer.loss.cispo]`: no lower bound by default (MiniMax-M1 imposes none)."""

    model_config = ConfigDict(extra="forbid")
    clip_low: float = Field(1.0, ge=0, description="the weight's lower clip 1 - clip_low (1.0: none)")
    clip_high: float = Field(0.2, ge=0, description="the weight's upper clip 1 + clip_high")


@register_loss("cispo", CISPOOptions)
def cispo(tokens: PolicyTokens, options: CISPOOptions) -> PolicyLoss:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the clipped ratio as a stop-gradient weight of the log-likelihood.

        l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t lp_t,    d l_t / d lp_t = -clip(r_t, ...) A_t
    """
    r = tokens.log_r.detach().exp()
    weight = r.clamp(1 - options.clip_low, 1 + options.clip_high)
    return PolicyLoss(-weight * tokens.advantages * tokens.lp, clipped=weight != r)


class SAPOOptions(BaseModel):
    """`[trainer.loss.sapo]`: the paper's temperatures by default (verl's too)."""

    model_config = ConfigDict(extra="forbid")
    tau_pos: float = Field(1.0, gt=0, description="the gate's temperature where A > 0")
    tau_neg: float = Field(1.05, gt=0, description="the gate's temperature where A <= 0")


@register_loss("sapo", SAPOOptions, aggregation="seq-mean-token-mean")
def sapo(tokens: PolicyTokens, options: SAPOOptions) -> Tensor:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft gate instead of a hard clip.

        tau_t = tau_pos if A_t > 0 else tau_neg
        l_t = -A_t * sigmoid(tau_t (r_t - 1)) * 4 / tau_t
        d l_t / d lp_t = -A_t * 4 r_t sigmoid'(tau_t (r_t - 1)),  = -A_t at r_t = 1
    """
    a, log_r = tokens.advantages, tokens.log_r
    tau = log_r.new_full(log_r.shape, options.tau_neg).masked_fill(a > 0, options.tau_pos)
    return -a * (tau * (log_r.exp() - 1)).sigmoid() * 4 / tau


@register_loss("reinforce", truncatable=True)
def reinforce(tokens: PolicyTokens, options: NoOptions) -> Tensor:
    """REINFORCE (Williams 1992) with the correction's importance weight: `l_t = -sg(w_t) A_t lp_t` (w = 1 without
    a correction, min(w, high) when truncating)."""
    if tokens.weight is None:
        return -tokens.advantages * tokens.lp
    return -tokens.weight * tokens.advantages * tokens.lp
