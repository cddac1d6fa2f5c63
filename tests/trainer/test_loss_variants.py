"""The policy losses, importance corrections and aggregations of [trainer.loss] against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.trainer.test_loss import F, T, run
from trace_rl.config import LossConfig
from trace_rl.trainer.loss import compute_loss
log = math.log


def ratios(r, q=0.1):
    """(lp, lp_inf) with exp(lp - lp_inf) = r for each r, the sampler's probability q."""
    return [log(q * x) for x in r], [log(q)] * len(r)


# -- policies ---------------------------------------------------------------------------------------------


def test_ppo_clips_each_side_and_dual_clip_caps_negative_advantages():
    # r = [1.5, 0.5, 1.1, 0.5, 5], A = [1, 1, -1, -1, -1], clip 0.2 / 0.2:
    # t0: max(-1.5, -1.2) = -1.2 clipped (no gradient); t1: max(-0.5, -0.8) = -0.5, grad -A r = -0.5;
    # t2: 1.1 inside the clip, grad -A r = 1.1; t3: max(0.5, 0.8) = 0.8 clipped; t4: max(5, 1.2) = 5, grad 5
    lp, lp_inf = ratios([1.5, 0.5, 1.1, 0.5, 5.0])
    rl = ([1.0, 1.0, -1.0, -1.0, -1.0], [T] * 5)
    scales = {"rl": 5, "ce": 0}
    loss, grad, metrics = run(lp, lp_inf, rl=rl, scales=scales, policy="ppo", ppo={"clip_low": 0.2, "clip_high": 0.2})
    assert loss == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8 + 5.0) / 5)
    assert grad == pytest.approx([0.0, -0.5 / 5, 1.1 / 5, 0.0, 5.0 / 5])
    assert metrics["clipped_fraction"] == pytest.approx(2 / 5) and metrics["trust_region_masked"] == 0.0
    # dual clip c = 3: t4 (A < 0) loses min(5, -3 A) = 3, without gradient
    loss, grad, metrics = run(lp, lp_inf, rl=rl, scales=scales, policy="ppo",
                              ppo={"clip_low": 0.2, "clip_high": 0.2, "clip_c": 3.0})
    assert loss == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8 + 3.0) / 5)
    assert grad == pytest.approx([0.0, -0.5 / 5, 1.1 / 5, 0.0, 0.0])
    assert metrics["clipped_fraction"] == pytest.approx(3 / 5)


def test_ppo_clip_higher_moves_only_the_upper_bound():
    # DAPO's clip-higher: clip_high = 0.6 lets t0 (r = 1.5, A > 0) keep its gradient; the lower bound stays 0.8
    lp, lp_inf = ratios([1.5, 0.5])
    loss, grad, _ = run(lp, lp_inf, rl=([1.0, -1.0], [T, T]), scales={"rl": 2, "ce": 0}, policy="ppo",
                        ppo={"clip_high": 0.6})
    assert loss == pytest.approx((-1.5 + 0.8) / 2) and grad == pytest.approx([-1.5 / 2, 0.0])


def test_gspo_clips_the_sequence_ratio_and_means_over_sequences():
    # seq 0: r = [2, 1], A = +1: s = exp((log 2 + 0) / 2) = sqrt 2 > 1.2: each token -1.2, no gradient
    # seq 1: a prompt token, then r = [0.9, 1.0], A = -1: s = sqrt(0.9) inside [0.8, 1.2]: each token s, gradient
    #        -A s per token; its tokens' mean is s; seq-mean-token-mean (gspo's default) over the 2 sequences
    s = math.sqrt(0.9)
    lp = [log(0.2), log(0.1), -2.0, log(0.09), log(0.1)]
    lp_inf = [log(0.1), log(0.1), 0.0, log(0.1), log(0.1)]
    rl = ([1.0, 1.0, 0.0, -1.0, -1.0], [T, T, F, T, T])
    scales = {"rl": 4, "ce": 0, "rl_sequences": 2, "ce_sequences": 0}
    loss, grad, metrics = run(lp, lp_inf, rl=rl, scales=scales, lengths=[2, 3], policy="gspo",
                              gspo={"clip_low": 0.2, "clip_high": 0.2})
    assert loss == pytest.approx((-1.2 + s) / 2)
    assert grad == pytest.approx([0.0, 0.0, 0.0, s / 2 / 2, s / 2 / 2])
    assert metrics["clipped_fraction"] == pytest.approx(2 / 4)
    # the same tokens as one sequence: s = exp(mean of [log 2, 0, log 0.9, 0]) and one mean over four tokens
    s1 = math.exp((log(2) + log(0.9)) / 4)
    one = {"rl": 4, "ce": 0, "rl_sequences": 1, "ce_sequences": 0}
    loss, grad, _ = run(lp, lp_inf, rl=rl, scales=one, lengths=[5], policy="gspo",
                        gspo={"clip_low": 0.2, "clip_high": 0.2})
    assert loss == pytest.approx((-s1 - s1 + s1 + s1) / 4) and grad == pytest.approx(
        [-s1 / 4, -s1 / 4, 0.0, s1 / 4, s1 / 4])


def test_cispo_weights_the_log_likelihood_with_the_clipped_ratio():
    # r = [1.5, 0.5, 1.0], A = [1, -1, 2], clip 0.2 / 0.2: weights [1.2, 0.8, 1.0]; l = -w A lp, grad -w A
    lp, lp_inf = ratios([1.5, 0.5, 1.0])
    loss, grad, metrics = run(lp, lp_inf, rl=([1.0, -1.0, 2.0], [T, T, T]), scales={"rl": 3, "ce": 0},
                              policy="cispo", cispo={"clip_low": 0.2, "clip_high": 0.2})
    assert loss == pytest.approx((-1.2 * lp[0] + 0.8 * lp[1] - 2.0 * lp[2]) / 3)
    assert grad == pytest.approx([-1.2 / 3, 0.8 / 3, -2.0 / 3])
    assert metrics["clipped_fraction"] == pytest.approx(2 / 3)
    # default: no lower bound (1 - 1.0 = 0), upper 1.2
    _, grad, _ = run(lp, lp_inf, rl=([1.0, -1.0, 2.0], [T, T, T]), scales={"rl": 3, "ce": 0}, policy="cispo")
    assert grad == pytest.approx([-1.2 / 3, 0.5 / 3, -2.0 / 3])


def test_sapo_soft_gate():
    # t0: r = 1, A = 1, tau_pos = 1: l = -sigmoid(0) * 4 = -2, grad -A * 4 r sigmoid'(0) = -1 (the plain gradient)
    # t1: r = 2, A = -1, tau_neg = 2: l = sigmoid(2) * 4 / 2, grad 4 r sigmoid(2) (1 - sigmoid(2))
    sig = 1 / (1 + math.exp(-2.0))
    lp, lp_inf = ratios([1.0, 2.0])
    scales = {"rl": 2, "ce": 0, "rl_sequences": 2, "ce_sequences": 0}
    loss, grad, _ = run(lp, lp_inf, rl=([1.0, -1.0], [T, T]), scales=scales, lengths=[1, 1], policy="sapo",
                        sapo={"tau_pos": 1.0, "tau_neg": 2.0})
    # sapo's default aggregation is seq-mean-token-mean: each token is its own sequence here
    assert loss == pytest.approx((-2.0 + 2 * sig) / 2)
    assert grad == pytest.approx([-1.0 / 2, 4 * 2 * sig * (1 - sig) / 2])


def test_reinforce_is_the_plain_policy_gradient():
    lp, lp_inf = ratios([3.0, 0.5])
    loss, grad, _ = run(lp, lp_inf, rl=([2.0, -1.0], [T, T]), scales={"rl": 2, "ce": 0}, policy="reinforce")
    assert loss == pytest.approx((-2.0 * lp[0] + lp[1]) / 2) and grad == pytest.approx([-1.0, 0.5])


# -- corrections -------------------------------------------------------------------------------------------


TWO_SEQUENCES = {"rl": 4, "ce": 0, "rl_sequences": 2, "ce_sequences": 0}


@pytest.mark.parametrize("level, weights", [
    # seq 0: r = [2, 1.5], seq 1: r = [0.5, 1]; truncated at 2
    ("token", [2.0, 1.5, 0.5, 1.0]),
    ("sequence", [2.0, 2.0, 0.5, 0.5]),                                       # products 3 -> 2, and 0.5
    ("geometric", [math.sqrt(3), math.sqrt(3), math.sqrt(0.5), math.sqrt(0.5)]),
])
def test_reinforce_with_truncated_weights_at_each_level(level, weights):
    lp, lp_inf = ratios([2.0, 1.5, 0.5, 1.0])
    adv = [1.0, 1.0, -1.0, -1.0]
    loss, grad, metrics = run(lp, lp_inf, rl=(adv, [T] * 4), scales=TWO_SEQUENCES, lengths=[2, 2],
                              policy="reinforce", correction={"level": level, "high": 2.0})
    assert grad == pytest.approx([-w * a / 4 for w, a in zip(weights, adv)])
    assert loss == pytest.approx(sum(-w * a * x for w, a, x in zip(weights, adv, lp)) / 4)
    capped = {"token": 0, "sequence": 2, "geometric": 0}[level]  # token level: r = 2 is at the cap, not above
    assert metrics["mismatch/is_capped_fraction"] == pytest.approx(capped / 4)


def test_dppo_sequence_truncation_replaces_the_ratio_by_the_capped_sequence_weight():
    # seq r = [3, 1]: w = 3 -> 2; the policy term is -A * 2 in value and gradient on both tokens (kl_tau = 0)
    lp, lp_inf = ratios([3.0, 1.0])
    wide = {"dppo": {"mask_high": 1.0, "mask_low": 1.0, "kl_tau": 0.0}}
    loss, grad, _ = run(lp, lp_inf, rl=([1.0, 0.5], [T, T]), scales={"rl": 2, "ce": 0}, lengths=[2],
                        correction={"level": "sequence", "high": 2.0}, **wide)
    assert loss == pytest.approx((-2.0 - 1.0) / 2) and grad == pytest.approx([-1.0, -0.5])
    # max_is_ratio is the token/truncate shorthand: the same numbers as correction = {high = C}
    short = run(lp, lp_inf, rl=([1.0, 0.5], [T, T]), scales={"rl": 2, "ce": 0}, max_is_ratio=2.0, **wide)
    long = run(lp, lp_inf, rl=([1.0, 0.5], [T, T]), scales={"rl": 2, "ce": 0}, correction={"high": 2.0}, **wide)
    assert short == long and short[1] == pytest.approx([-2.0 / 2, -0.5 * 1.0 / 2])  # token 1: r = 1


def test_token_mask_drops_tokens_outside_the_bounds_from_the_whole_loss():
    # r = [3, 1.25, 0.25] with bounds [0.5, 2]: t0 and t2 leave the loss, kl term included; t1 stays (dppo)
    tau = 0.1
    lp, lp_inf = ratios([3.0, 1.25, 0.25])
    wide = {"dppo": {"mask_high": 1.0, "mask_low": 1.0, "kl_tau": tau}}
    loss, grad, metrics = run(lp, lp_inf, rl=([1.0, 1.0, 1.0], [T] * 3), scales={"rl": 3, "ce": 0},
                              correction={"mode": "mask", "low": 0.5, "high": 2.0}, **wide)
    x = log(1.25)
    assert loss == pytest.approx((-1.25 + tau * x * x) / 3)
    assert grad == pytest.approx([0.0, (-1.25 + 2 * tau * x) / 3, 0.0])
    assert metrics["mismatch/masked_fraction"] == pytest.approx(2 / 3)
    assert metrics["mismatch/is_capped_fraction"] == 0.0


def test_sequence_mask_drops_whole_sequences_for_any_policy():
    # seq 0: r = [3, 1] product 3 > 2 leaves; seq 1: r = [1.25, 1] product 1.25 stays (ppo, inside its clip for
    # t3 only: t2 at 1.25 > 1.2 is clipped for A > 0)
    lp, lp_inf = ratios([3.0, 1.0, 1.25, 1.0])
    loss, grad, metrics = run(lp, lp_inf, rl=([1.0] * 4, [T] * 4), scales=TWO_SEQUENCES, lengths=[2, 2],
                              policy="ppo", correction={"level": "sequence", "mode": "mask", "high": 2.0})
    assert loss == pytest.approx((-1.2 - 1.0) / 4) and grad == pytest.approx([0.0, 0.0, 0.0, -1.0 / 4])
    assert metrics["mismatch/masked_fraction"] == pytest.approx(2 / 4)


@pytest.mark.parametrize("policy", ["dppo", "ppo", "sapo", "reinforce"])
def test_masked_tokens_with_overflowing_ratios_leave_finite_gradients(policy):
    # r = exp(200) (inf in float32 arithmetic of the ratio) and exp(-200): both masked, nothing of them is left
    loss, grad, metrics = run([-1.0, -201.0, -1.0], [-201.0, -1.0, -1.0], rl=([1.0, 1.0, 1.0], [T, T, T]),
                              scales={"rl": 3, "ce": 0, "rl_sequences": 1, "ce_sequences": 0}, policy=policy,
                              correction={"mode": "mask", "low": 0.5, "high": 2.0})
    assert all(math.isfinite(g) for g in grad) and grad[:2] == [0.0, 0.0] and grad[2] == pytest.approx(-1 / 3)
    assert metrics["mismatch/masked_fraction"] == pytest.approx(2 / 3)


# -- aggregation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation, loss, grad", [
    # ce on seq 0 (tokens 1, 2: losses 2 and 4), none on seq 1, on seq 2 token 6 (w 2 at lp -0.5: loss 1)
    ("token-mean", 7 / 3, [0, -1 / 3, -1 / 3, 0, 0, 0, -2 / 3, 0]),
    ("seq-mean-token-mean", (6 / 2 + 1 / 1) / 2, [0, -1 / 4, -1 / 4, 0, 0, 0, -2 / 2, 0]),
    ("seq-mean-token-sum", (6 + 1) / 2, [0, -1 / 2, -1 / 2, 0, 0, 0, -2 / 2, 0]),
    ("seq-mean-token-sum-norm", (6 + 1) / (2 * 4), [0, -1 / 8, -1 / 8, 0, 0, 0, -2 / 8, 0]),
])
def test_aggregations(aggregation, loss, grad):
    lp = [0.0, -2.0, -4.0, -1.0, -1.0, -1.0, -0.5, -1.0]
    ce = ([0, 1, 1, 0, 0, 0, 2, 0], [F, T, T, F, F, F, T, F])
    norm = {"norm_tokens": 4} if aggregation.endswith("norm") else {}
    scales = {"rl": 0, "ce": 3, "rl_sequences": 0, "ce_sequences": 2}
    got, g, metrics = run(lp, [0.0] * 8, ce=ce, scales=scales, lengths=[3, 2, 3], aggregation=aggregation, **norm)
    assert got == pytest.approx(loss) and g == pytest.approx(grad) and metrics["loss/ce"] == pytest.approx(loss)


def random_step(seed: int, n: int = 9):
    """A step of n sequences (a prompt, then rl or ce tokens) with mismatched sampler logprobs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 9, n).tolist()
    total = sum(lengths)
    lp_inf = -rng.uniform(0.5, 3.0, total)
    lp = lp_inf + rng.normal(0, 0.3, total)
    completion = np.concatenate([np.arange(k) >= k // 2 for k in lengths])
    is_ce = np.repeat(rng.random(n) < 0.3, lengths)
    rl_mask = completion & ~is_ce & (rng.random(total) < 0.9)
    ce_mask = completion & is_ce
    adv = np.repeat(rng.normal(0, 1, n), lengths) * rl_mask
    return lengths, lp, lp_inf, (adv, rl_mask), (ce_mask * 1.0, ce_mask)


def loss_over(chunks, lengths, lp, lp_inf, rl, ce, config):
    """The step's loss, gradient and metrics with the sequences cut into micro-batches of `chunks` sequences."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    seq_of = np.repeat(np.arange(len(lengths)), lengths)
    scales = {"rl": rl[1].sum(), "ce": ce[1].sum(), "rl_sequences": len(np.unique(seq_of[rl[1]])),
              "ce_sequences": len(np.unique(seq_of[ce[1]]))}
    lp_t = torch.tensor(lp, requires_grad=True)
    total, metrics = 0.0, {}
    for group in chunks:
        a, b = starts[group[0]], starts[group[-1] + 1]
        channels = {"rl": (torch.tensor(rl[0][a:b]), torch.tensor(rl[1][a:b])),
                    "ce": (torch.tensor(ce[0][a:b]), torch.tensor(ce[1][a:b]))}
        loss, m = compute_loss(lp_t[a:b], torch.tensor(lp_inf[a:b]), channels, scales, config,
                               sequence_lengths=[lengths[i] for i in group])
        total = total + loss
        for k, v in m.items():
            v = float(v)
            metrics[k] = min(metrics.get(k, v), v) if k.endswith("_min") else (
                max(metrics.get(k, v), v) if k.endswith("_max") else metrics.get(k, 0.0) + v)
    total.backward()
    return total.item(), lp_t.grad.numpy(), metrics


@pytest.mark.parametrize("loss", [
    {}, {"aggregation": "seq-mean-token-mean"}, {"aggregation": "seq-mean-token-sum"},
    {"aggregation": "seq-mean-token-sum-norm", "norm_tokens": 8}, {"policy": "ppo", "ppo": {"clip_c": 3.0}},
    {"policy": "gspo"}, {"policy": "cispo", "aggregation": "seq-mean-token-sum"}, {"policy": "sapo"},
    {"policy": "reinforce", "correction": {"level": "geometric", "high": 1.1}},
    {"correction": {"level": "sequence", "mode": "mask", "low": 0.8, "high": 1.25}},
])
def test_the_step_does_not_depend_on_how_sequences_are_packed(loss):
    lengths, lp, lp_inf, rl, ce = random_step(3)
    config = LossConfig(**loss)
    whole = loss_over([list(range(9))], lengths, lp, lp_inf, rl, ce, config)
    three = loss_over([[0, 1, 2], [3, 4, 5], [6, 7, 8]], lengths, lp, lp_inf, rl, ce, config)
    # compute_loss runs in float32: equal within its rounding
    assert three[0] == pytest.approx(whole[0], rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(three[1], whole[1], rtol=1e-6, atol=1e-7)
    assert three[2] == pytest.approx(whole[2], rel=1e-6, abs=1e-7)
    assert whole[0] != 0.0 and np.abs(whole[1]).max() > 0


def test_raw_ratio_metrics_over_tokens_and_sequences():
    # seq 0: r = [2, 0.5]; seq 1: a ce token, then r = [4]; seq 2: no rl token
    lp, lp_inf = ratios([2.0, 0.5, 1.0, 4.0, 1.0])
    rl = ([1.0, 1.0, 0.0, 1.0, 0.0], [T, T, F, T, F])
    ce = ([0.0, 0.0, 1.0, 0.0, 0.0], [F, F, T, F, F])
    scales = {"rl": 3, "ce": 1, "rl_sequences": 2, "ce_sequences": 1}
    _, _, m = run(lp, lp_inf, rl=rl, ce=ce, scales=scales, lengths=[2, 2, 1])
    assert m["mismatch/token_ratio_mean"] == pytest.approx((2 + 0.5 + 4) / 3)
    assert (m["mismatch/token_ratio_min"], m["mismatch/token_ratio_max"]) == pytest.approx((0.5, 4.0))
    assert m["mismatch/seq_ratio_mean"] == pytest.approx((1.0 + 4.0) / 2)  # products 2 * 0.5 and 4
    assert (m["mismatch/seq_ratio_min"], m["mismatch/seq_ratio_max"]) == pytest.approx((1.0, 4.0))
    assert m["mismatch/seq_geo_ratio_mean"] == pytest.approx((1.0 + 4.0) / 2)
