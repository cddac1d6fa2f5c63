"""The training losses over per-token logprobs of a packed micro-batch: the rl channel's policy loss (a registered
loss, `trace_rl.losses`), the importance correction it sees, the ce loss, the KL penalty and the reduction.

Every per-token tensor is 1-D and aligned with the packed tokens; a micro-batch holds whole
sequences (training samples), `sequence_lengths` of them in order. The policy loss gives
each rl token's loss; `reduce_token_losses` turns a channel's token losses into its share of the step's
loss, dividing by *step-wide* counts (tokens or sequences with a token of that channel, over
all micro-batches and all ranks, at least 1). Summing the micro-batch losses over a step
therefore gives the step's loss whatever the packing and the number of ranks, and an echo
(ce) token never dilutes the rl gradient, nor the reverse. Formulas: docs/trainer.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel

from trace_rl.config import CorrectionConfig, KLConfig, LossConfig
from trace_rl.losses import LossError, PolicyLoss, PolicyTokens, RegisteredLoss, resolve_loss
from trace_rl.losses.tokens import per_sequence, sequence_mean

TokenChannel = tuple[torch.Tensor, torch.Tensor]  # (values float, mask bool), both aligned with the tokens


# -- sequences ------------------------------------------------------------------------------


def sequence_index(sequence_lengths: Sequence[int] | torch.Tensor | None, num_tokens: int,
                   device: torch.device) -> tuple[torch.Tensor, int]:
    """Each token's sequence (0, 0, 1, 1, 1, ...) and the number of sequences; None: one sequence of all tokens."""
    if sequence_lengths is None:
        return torch.zeros(num_tokens, dtype=torch.long, device=device), 1
    lengths = torch.as_tensor(sequence_lengths, dtype=torch.long, device=device)
    if int(lengths.sum()) != num_tokens or bool((lengths <= 0).any()):
        raise ValueError(f"sequence_lengths {lengths.tolist()} must be positive and sum to the {num_tokens} tokens")
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths), len(lengths)


# -- importance weights -------------------------------------------------------------------------


def log_importance_weight(log_r: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, count: int,
                          level: str) -> torch.Tensor:
    """The log of the importance weight each token is corrected with (detached; `log_r` is 0 outside `mask`).

        token:      log w_t = log_r_t
        sequence:   log w_t = sum_{u in seq(t), u in mask} log_r_u      (w: the product of the ratios; verl)
        geometric:  log w_t = mean_{u in seq(t), u in mask} log_r_u     (the length-normalized form, TRL #5815)
    """
    log_r = log_r.detach()
    if level == "token":
        return log_r
    if level == "geometric":
        return sequence_mean(log_r, mask, index, count)
    return per_sequence(log_r, index, count)[index]


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


def weighted_ratio(log_r: torch.Tensor, log_w: torch.Tensor | None, cap: float | None) -> torch.Tensor:
    """The ratio of dppo's policy term: the importance weight `w` in value, `w · ∇lp` in gradient.

        r~ = sg(min(w, C)) * exp(log_r - sg(log_r))       (C = cap; none: min(w, C) = w)

    `log_w = None` is the token level (w = r): `truncated_ratio(log_r, cap)`, today's arithmetic exactly.
    """
    if log_w is None:
        return truncated_ratio(log_r, cap)
    w = torch.exp(log_w.detach())
    if cap is not None:
        w = torch.clamp(w, max=cap)
    return w * torch.exp(log_r - log_r.detach())


def correction_keep(log_w: torch.Tensor, correction: CorrectionConfig | None) -> torch.Tensor | None:
    """Masked importance sampling (MIS / IcePop): keep a token iff `low <= w <= high`; None when not masking."""
    if correction is None or correction.mode != "mask":
        return None
    w = torch.exp(log_w.detach())
    return (w >= (correction.low or 0.0)) & (w <= correction.high)


# -- the rl channel: the policy loss of its tokens ------------------------------------------------------


def rl_token_loss(lp: torch.Tensor, lp_inf: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  index: torch.Tensor, count: int, loss: RegisteredLoss, options: BaseModel,
                  correction: CorrectionConfig | None) -> tuple[torch.Tensor, ...]:
    """Each rl token's loss under the policy loss `loss` with its `options`, and `correction` (0 outside `mask`),
    and per token whether the correction truncated it or masked it, and the policy clipped it or dropped it (bool
    tensors; the last two only on the tokens left in the loss)."""
    log_r = torch.where(mask, lp - lp_inf, torch.zeros_like(lp))  # zero outside the mask: exp never overflows there
    level = correction.level if correction is not None else "token"
    log_w = log_importance_weight(log_r, mask, index, count, level)
    keep = correction_keep(log_w, correction)
    cap = correction.high if correction is not None and correction.mode == "truncate" else None
    truncated = mask & (torch.exp(log_w) > cap) if cap is not None else torch.zeros_like(mask)
    masked = mask & ~keep if keep is not None else torch.zeros_like(mask)
    if keep is not None:  # a masked token leaves the loss (and gspo's sequence mean); its ratio may be inf: use 1
        mask = mask & keep
        log_r = torch.where(keep, log_r, torch.zeros_like(log_r))
        log_w = torch.where(keep, log_w, torch.zeros_like(log_w))
    weight = None if correction is None else torch.exp(log_w)
    if cap is not None:
        weight = torch.clamp(weight, max=cap)
    tokens = PolicyTokens(lp=lp, lp_inf=lp_inf, advantages=advantages, mask=mask, log_r=log_r,
                          ratio=weighted_ratio(log_r, None if level == "token" else log_w, cap), weight=weight,
                          sequence=index, sequences=count)
    result = loss.function(tokens, options)
    result = result if isinstance(result, PolicyLoss) else PolicyLoss(result)
    if not isinstance(result.loss, torch.Tensor) or result.loss.shape != lp.shape:
        got = tuple(result.loss.shape) if isinstance(result.loss, torch.Tensor) else type(result.loss).__name__
        raise LossError(f"policy loss {loss.name!r} returned {got}: it must return one loss per token, a tensor "
                        f"of shape {tuple(lp.shape)}")
    clipped, dropped = (mask & flags if flags is not None else torch.zeros_like(mask)
                        for flags in (result.clipped, result.dropped))
    return torch.where(mask, result.loss, torch.zeros_like(result.loss)), truncated, masked, clipped, dropped


def ce_token_loss(lp: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weighted cross-entropy (negative log-likelihood) of the target tokens: `l_t = -w_t * lp_t` on the mask."""
    return torch.where(mask, -weights * lp, torch.zeros_like(lp))


# -- KL penalty toward a reference model --------------------------------------------------------------


def kl_estimate(lp: torch.Tensor, lp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi, with `d = lp - lp_ref` (Schulman 2020,
    "Approximating KL Divergence"; the names are verl's `kl_penalty` ones):

        k1:   d                                 d/d lp = 1
        k2:   d**2 / 2                          d/d lp = d
        k3:   exp(-d) - 1 + d                   d/d lp = 1 - exp(-d)        (unbiased, always >= 0)
        k3+:  k3's value, k2's gradient: sg(k3) + k2 - sg(k2)              d/d lp = d

    k2's gradient is the one whose expectation is the gradient of the reverse KL (Liu et al. 2025, "Rethinking
    KL Regularization in RLHF"), hence k3+. `lp_ref` carries no gradient.
    """
    d = lp - lp_ref.detach()
    if estimator == "k1":
        return d
    k2 = d**2 / 2
    if estimator == "k2":
        return k2
    k3 = torch.exp(-d) - 1 + d
    if estimator == "k3":
        return k3
    if estimator == "k3+":
        return k3.detach() + k2 - k2.detach()
    raise ValueError(f"unknown trainer.loss.kl.estimator {estimator!r}")


def kl_penalty(lp: torch.Tensor, lp_ref: torch.Tensor, mask: torch.Tensor, kl: KLConfig) -> torch.Tensor:
    """The KL term's token losses: `coef * estimator(lp - lp_ref)` on the rl tokens, 0 elsewhere (where `lp_ref`
    may be anything: it is never read)."""
    safe_ref = torch.where(mask, lp_ref, lp.detach())
    return torch.where(mask, kl.coef * kl_estimate(lp, safe_ref, kl.estimator), torch.zeros_like(lp))


# -- aggregation -------------------------------------------------------------------------------------


def reduce_token_losses(per_token: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, count: int, tokens: float,
              sequences: float, mode: str, norm_tokens: int | None = None) -> torch.Tensor:
    """One channel's share of the step's loss: its token losses `l_t` (0 outside `mask`) over the step-wide
    `tokens` (tokens in the mask) or `sequences` (sequences with a token in it), both at least 1.

        token-mean               sum_t l_t / tokens                              (every token weighs the same)
        seq-mean-token-mean      sum_i (sum_{t in i} l_t / n_i) / sequences      (n_i: sequence i's masked tokens)
        seq-mean-token-sum       sum_i sum_{t in i} l_t / sequences
        seq-mean-token-sum-norm  sum_i sum_{t in i} l_t / (sequences * norm_tokens)   (Dr. GRPO, arXiv 2503.20783)

    Sequences are whole in a micro-batch, so each is summed here and only the divisors are step-wide.
    """
    if mode == "token-mean":
        return per_token.sum() / max(float(tokens), 1.0)
    per_seq = per_sequence(per_token, index, count)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / per_sequence(mask.to(per_token.dtype), index, count).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if norm_tokens is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_tokens")
        per_seq = per_seq / norm_tokens
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown trainer.loss.aggregation {mode!r}")
    return per_seq.sum() / max(float(sequences), 1.0)


# -- metrics ----------------------------------------------------------------------------------------


def mismatch_k3_kl_sum(lp: torch.Tensor, lp_inf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(inference || trainer) per token, summed: `r - log_r - 1` with `log_r = lp - lp_inf`."""
    log_r = torch.where(mask, lp.detach() - lp_inf, torch.zeros_like(lp_inf))
    return torch.where(mask, torch.exp(log_r) - log_r - 1, torch.zeros_like(log_r)).sum()


def mismatch_abs_diff_sum(lp: torch.Tensor, lp_inf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How far trainer and sampler disagree on the same tokens, summed: `|lp - lp_inf|`."""
    return torch.where(mask, (lp.detach() - lp_inf).abs(), torch.zeros_like(lp_inf)).sum()


def ratio_stats(lp: torch.Tensor, lp_inf: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, count: int,
                tokens: float, sequences: float) -> dict[str, torch.Tensor]:
    """The raw ratios before any cap, in float64: `r_t` over the rl tokens, the sequence's product
    `exp(sum log_r)` and geometric mean `exp(mean log_r)` over the sequences with rl tokens. Means are this
    micro-batch's share of the step's mean (additive); `_min` / `_max` are this micro-batch's (+inf / -inf
    without rl tokens: the trainer reduces them with min / max)."""
    log_r = torch.where(mask, lp.detach().double() - lp_inf.double(), 0.0)
    n = per_sequence(mask.double(), index, count)
    has = n > 0
    seq_sum = per_sequence(log_r, index, count)
    values = {
        "token_ratio": (torch.exp(log_r), mask, tokens),
        "seq_ratio": (torch.exp(seq_sum.clamp(max=700.0)), has, sequences),
        "seq_geo_ratio": (torch.exp(seq_sum / n.clamp(min=1)), has, sequences),
    }
    stats = {}
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=lp.device)
    for name, (x, where, scale) in values.items():
        stats[f"mismatch/{name}_mean"] = torch.where(where, x, 0.0).sum() / max(float(scale), 1.0)
        stats[f"mismatch/{name}_min"] = torch.where(where, x, inf).min() if len(x) else inf
        stats[f"mismatch/{name}_max"] = torch.where(where, x, -inf).max() if len(x) else -inf
    return stats


# -- the loss of a micro-batch ----------------------------------------------------------------------------


def compute_loss(
    lp: torch.Tensor,
    lp_inf: torch.Tensor,
    channels: dict[str, TokenChannel],
    scales: dict[str, float],
    config: LossConfig,
    sequence_lengths: Sequence[int] | torch.Tensor | None = None,
    lp_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss = reduce_token_losses(rl token losses) + reduce_token_losses(ce token losses)` for one micro-batch,
    and its metrics; with `config.kl`, plus the same reduction of `coef * estimator(lp - lp_ref)` over the rl
    tokens (`loss/kl`), where `lp_ref` are the reference model's logprobs of the tokens (aligned with `lp`). The
    rl token losses are those of the registered policy loss `config.policy` (`trace_rl.losses`).

    `channels` maps "rl" and "ce" to (values, mask); rl values are the advantages,
    ce values the token weights. `scales` maps the same names to the step-wide token
    counts and "rl_sequences" / "ce_sequences" to the step-wide numbers of sequences with
    a token of that channel (each clamped to at least 1; the sequence counts are needed by the
    seq-mean aggregations only). `sequence_lengths` are the micro-batch's samples in order,
    summing to its tokens (None: one sequence). `config.norm_tokens` must be resolved for
    seq-mean-token-sum-norm (the trainer sets it from the run's sampling).

    Every metric but the `_min` / `_max` ones is this micro-batch's share of a step-wide figure,
    so summing them over micro-batches (and ranks) gives the step's value: per-channel losses
    and token counts; over rl tokens the mean |lp - lp_inf|, the mean k3 mismatch KL, the
    fractions the correction truncated (`mismatch/is_capped_fraction`) or masked
    (`mismatch/masked_fraction`), the policy loss clipped (`clipped_fraction`) and its trust
    region dropped (`trust_region_masked`), of the tokens left in the loss; the raw ratios
    (`ratio_stats`). Metrics are detached 0-d tensors so a step can sum and all-reduce them
    without a sync each. A micro-batch without masked tokens gives a zero
    loss still attached to `lp`, so its backward runs (and yields zero gradients).
    """
    lp = lp.float()
    lp_inf = lp_inf.float()
    rl_values, rl_mask = channels["rl"]
    ce_values, ce_mask = channels["ce"]
    rl_values, ce_values = rl_values.float(), ce_values.float()
    index, count = sequence_index(sequence_lengths, len(lp), lp.device)
    policy, options, mode = resolve_loss(config)
    rl_tokens, ce_tokens = float(scales["rl"]), float(scales["ce"])
    rl_sequences, ce_sequences = float(scales.get("rl_sequences", 0)), float(scales.get("ce_sequences", 0))
    if mode != "token-mean" and ("rl_sequences" not in scales or "ce_sequences" not in scales):
        raise ValueError(f"aggregation {mode!r} needs the step-wide 'rl_sequences' and 'ce_sequences' in scales")

    per_token, truncated, masked, clipped, dropped = rl_token_loss(lp, lp_inf, rl_values, rl_mask, index, count,
                                                                   policy, options, config.importance_correction)
    rl = reduce_token_losses(per_token, rl_mask, index, count, rl_tokens, rl_sequences, mode, config.norm_tokens)
    ce = reduce_token_losses(ce_token_loss(lp, ce_values, ce_mask), ce_mask, index, count, ce_tokens, ce_sequences,
                             mode, config.norm_tokens)
    kl = None
    if config.kl is not None:
        if lp_ref is None:
            raise ValueError("trainer.loss.kl needs the reference's logprobs (lp_ref): the batch has no ref_logprobs")
        kl = reduce_token_losses(kl_penalty(lp, lp_ref.float(), rl_mask, config.kl), rl_mask, index, count,
                                 rl_tokens, rl_sequences, mode, config.norm_tokens)
    rl_scale = max(rl_tokens, 1.0)
    with torch.no_grad():
        metrics = {
            "loss/rl": rl.detach(),
            "loss/ce": ce.detach(),
            "tokens/rl": rl_mask.sum().float(),
            "tokens/ce": ce_mask.sum().float(),
            "mismatch/mean_abs_logprob_diff": mismatch_abs_diff_sum(lp, lp_inf, rl_mask) / rl_scale,
            "mismatch/k3_kl": mismatch_k3_kl_sum(lp, lp_inf, rl_mask) / rl_scale,
            "mismatch/is_capped_fraction": truncated.sum().float() / rl_scale,
            "mismatch/masked_fraction": masked.sum().float() / rl_scale,
            "clipped_fraction": clipped.sum().float() / rl_scale,
            "trust_region_masked": dropped.sum().float() / rl_scale,
            **ratio_stats(lp, lp_inf, rl_mask, index, count, rl_tokens, rl_sequences),
        }
    if kl is None:
        return rl + ce, metrics
    metrics["loss/kl"] = kl.detach()
    return rl + ce + kl, metrics
