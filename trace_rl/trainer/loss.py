"""The training losses, one function each, over per-token logprobs of a packed micro-batch.

Every per-token tensor is 1-D and aligned with the packed tokens. Each loss is a
sum over its own mask divided by its own *step-wide* scale: the number of tokens
in that mask over all micro-batches and all ranks (at least 1). Summing the
micro-batch losses over a step therefore gives the mean over the step's tokens of
each channel, and an echo (ce) token never dilutes the rl gradient, nor the reverse.
"""

from __future__ import annotations

import torch

from trace_rl.config import LossConfig

Channel = tuple[torch.Tensor, torch.Tensor]  # (values float, mask bool), both aligned with the tokens


def trust_region_keep(
    advantages: torch.Tensor, lp: torch.Tensor, lp_inf: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """DPPO trust-region mask on the probability difference `dp = exp(lp) - exp(lp_inf)`.

    A token leaves the policy term when the update would push it further out of the
    region: `A > 0 and dp > dppo_mask_high`, or `A < 0 and dp < -dppo_mask_low`.
    """
    dp = torch.exp(lp.detach()) - torch.exp(lp_inf)
    dropped = ((advantages > 0) & (dp > config.dppo_mask_high)) | ((advantages < 0) & (dp < -config.dppo_mask_low))
    return ~dropped


def truncated_ratio(log_r: torch.Tensor, max_is_ratio: float | None) -> torch.Tensor:
    """The importance ratio `r = exp(log_r)`, truncated at `C = max_is_ratio` in value and gradient.

        r~ = sg(min(r, C)) * exp(log_r - sg(log_r))      (sg: stop-gradient; the exp is 1 in value)
        r~ = min(r, C),   d r~ / d lp = min(r, C)         (while d r / d lp = r)

    the same as `r * sg(min(r, C) / r)`, but finite where r under- or overflows. Truncated
    importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
    You Off-Policy RL Training"). `C = None` returns `r` untouched.
    """
    r = torch.exp(log_r)
    if max_is_ratio is None:
        return r
    return torch.clamp(r.detach(), max=max_is_ratio) * torch.exp(log_r - log_r.detach())


def rl_loss_sum(
    lp: torch.Tensor, lp_inf: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """Importance-weighted policy gradient with the DPPO mask, truncated ratios and a squared-log-ratio KL penalty.

        log_r = lp - lp_inf,  r = exp(log_r),  r~ = min(r, C) with gradient min(r, C) * d lp   (C = max_is_ratio)
        rl_sum = sum_{t in mask} [ -keep_t * A_t * r~_t + kl_tau * log_r_t**2 ]
        d rl_sum / d lp_t = -keep_t * A_t * min(r_t, C) + 2 * kl_tau * log_r_t

    Without `max_is_ratio`, r~ = r (C = inf). See `truncated_ratio`.
    """
    log_r = torch.where(mask, lp - lp_inf, torch.zeros_like(lp))  # zero outside the mask: exp never overflows there
    keep = trust_region_keep(advantages, lp, lp_inf, config)
    ratio = truncated_ratio(log_r, config.max_is_ratio)
    policy = torch.where(keep, advantages * ratio, torch.zeros_like(lp))
    per_token = -policy + config.kl_tau * log_r**2
    return torch.where(mask, per_token, torch.zeros_like(per_token)).sum()


def ce_loss_sum(lp: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weighted cross-entropy (negative log-likelihood) of the target tokens.

        ce_sum = sum_{t in mask} [ -w_t * lp_t ]
    """
    return torch.where(mask, -weights * lp, torch.zeros_like(lp)).sum()


def mismatch_k3_kl_sum(lp: torch.Tensor, lp_inf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(inference || trainer) per token, summed: `r - log_r - 1` with `log_r = lp - lp_inf`."""
    log_r = torch.where(mask, lp.detach() - lp_inf, torch.zeros_like(lp_inf))
    return torch.where(mask, torch.exp(log_r) - log_r - 1, torch.zeros_like(log_r)).sum()


def mismatch_abs_diff_sum(lp: torch.Tensor, lp_inf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How far trainer and sampler disagree on the same tokens, summed: `|lp - lp_inf|`."""
    return torch.where(mask, (lp.detach() - lp_inf).abs(), torch.zeros_like(lp_inf)).sum()


def capped_count(
    lp: torch.Tensor, lp_inf: torch.Tensor, mask: torch.Tensor, max_is_ratio: float | None
) -> torch.Tensor:
    """Tokens whose ratio exceeds the cap `C = max_is_ratio`: `#{t in mask: exp(lp_t - lp_inf_t) > C}` (0 if unset)."""
    if max_is_ratio is None:
        return lp.new_zeros(())
    r = torch.exp(lp.detach() - lp_inf)
    return (mask & (r > max_is_ratio)).sum().to(lp.dtype)


def compute_loss(
    lp: torch.Tensor,
    lp_inf: torch.Tensor,
    channels: dict[str, Channel],
    scales: dict[str, float],
    config: LossConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss = rl_sum / rl_scale + ce_sum / ce_scale` for one micro-batch, and its additive metrics.

    `channels` maps "rl" and "ce" to (values, mask); rl values are the advantages,
    ce values the token weights. `scales` maps the same names to the step-wide token
    counts (clamped to at least 1 here). Every metric is this micro-batch's share of
    a step-wide figure, so summing the metrics of all micro-batches (and ranks) gives
    the step's value: per-channel losses and token counts; over rl tokens the mean
    |lp - lp_inf|, the mean k3 mismatch KL and the fraction whose ratio exceeds
    `max_is_ratio` (`mismatch/...`), and the fraction dropped by the trust region. Metrics are
    detached 0-d tensors so a step can sum and all-reduce them without a sync each.
    A micro-batch without masked tokens gives a zero loss still attached to `lp`, so
    its backward runs (and yields zero gradients).
    """
    lp = lp.float()
    lp_inf = lp_inf.float()
    rl_values, rl_mask = channels["rl"]
    ce_values, ce_mask = channels["ce"]
    rl_scale = max(float(scales["rl"]), 1.0)
    ce_scale = max(float(scales["ce"]), 1.0)

    rl = rl_loss_sum(lp, lp_inf, rl_values.float(), rl_mask, config) / rl_scale
    ce = ce_loss_sum(lp, ce_values.float(), ce_mask) / ce_scale
    with torch.no_grad():
        dropped = rl_mask & ~trust_region_keep(rl_values.float(), lp, lp_inf, config)
        metrics = {
            "loss/rl": rl.detach(),
            "loss/ce": ce.detach(),
            "tokens/rl": rl_mask.sum().float(),
            "tokens/ce": ce_mask.sum().float(),
            "mismatch/mean_abs_logprob_diff": mismatch_abs_diff_sum(lp, lp_inf, rl_mask) / rl_scale,
            "mismatch/k3_kl": mismatch_k3_kl_sum(lp, lp_inf, rl_mask) / rl_scale,
            "mismatch/is_capped_fraction": capped_count(lp, lp_inf, rl_mask, config.max_is_ratio) / rl_scale,
            "trust_region_masked": dropped.sum().float() / rl_scale,
        }
    return rl + ce, metrics
