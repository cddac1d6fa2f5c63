"""The rl and ce losses against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from trace_rl.config import LossConfig
from trace_rl.trainer.loss import compute_loss

T, F = True, False


def run(lp, lp_inf, rl=None, ce=None, scales=None, lengths=None, **loss):
    """(loss, d loss / d lp, metrics) of `compute_loss` in float64; `lengths`: the sequences of the tokens."""
    lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    n = len(lp)
    none = ([0.0] * n, [F] * n)
    channels = {
        name: (torch.tensor(v, dtype=torch.float64), torch.tensor(m)) for name, (v, m) in
        {"rl": rl or none, "ce": ce or none}.items()
    }
    scales = scales or {"rl": 1, "ce": 1, "rl_sequences": 1, "ce_sequences": 1}
    total, metrics = compute_loss(lp, torch.tensor(lp_inf, dtype=torch.float64), channels, scales, LossConfig(**loss),
                                  sequence_lengths=lengths)
    total.backward()
    return total.item(), lp.grad.tolist(), {k: float(v) for k, v in metrics.items()}


def test_rl_with_ratio_one_is_minus_mean_advantage():
    lp = [-1.0, -2.0, -0.5]
    loss, grad, metrics = run(lp, lp, rl=([1.0, -2.0, 0.5], [T, T, F]), scales={"rl": 2, "ce": 0}, dppo={"kl_tau": 0.0})
    assert loss == pytest.approx((-1.0 + 2.0) / 2)
    # d(-A r)/d lp = -A r = -A at r = 1
    assert grad == pytest.approx([-0.5, 1.0, 0.0])
    assert metrics["tokens/rl"] == 2 and metrics["mismatch/k3_kl"] == pytest.approx(0.0)
    assert metrics["trust_region_masked"] == 0.0


def test_trust_region_drops_one_token_on_each_side():
    log = math.log
    # token 0: A > 0 and dp = 0.9 - 0.5 > 0.2  -> dropped
    # token 1: A < 0 and dp = 0.2 - 0.6 < -0.2 -> dropped
    # token 2: A < 0 and dp = +0.4: moving away from the bound on its side -> kept
    # token 3: A > 0 and dp = 0.1 inside the region -> kept
    lp = [log(0.9), log(0.2), log(0.9), log(0.5)]
    lp_inf = [log(0.5), log(0.6), log(0.5), log(0.4)]
    adv = [1.0, -1.0, -1.0, 1.0]
    loss, grad, metrics = run(lp, lp_inf, rl=(adv, [T] * 4), scales={"rl": 4, "ce": 0}, dppo={"kl_tau": 0.1})
    log_r = [log(0.9 / 0.5), log(0.2 / 0.6), log(0.9 / 0.5), log(0.5 / 0.4)]
    policy = [0.0, 0.0, 1.0 * 1.8, -1.0 * 1.25]
    assert loss == pytest.approx((sum(policy) + 0.1 * sum(x * x for x in log_r)) / 4)
    expected_grad = [(p + 2 * 0.1 * x) / 4 for p, x in zip(policy, log_r)]
    assert grad == pytest.approx(expected_grad)
    assert metrics["trust_region_masked"] == pytest.approx(2 / 4)
    assert metrics["mismatch/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in log_r) / 4)


def test_truncated_importance_sampling_caps_the_ratio_of_high_ratio_tokens():
    log, tau = math.log, 0.1
    # r = [3.0, 1.0, 1.25, 0.5]; the cap C = 2 binds on token 0 only. The trust region is opened wide
    # (dp of token 0 is 0.4) so that every token stays in the policy term.
    lp = [log(0.6), log(0.3), log(0.5), log(0.1)]
    lp_inf = [log(0.2), log(0.3), log(0.4), log(0.2)]
    adv = [1.0, -2.0, 0.5, 1.0]
    rl = (adv, [T, T, T, T])
    wide = {"dppo": {"mask_high": 1.0, "mask_low": 1.0, "kl_tau": tau}}
    loss, grad, metrics = run(lp, lp_inf, rl=rl, scales={"rl": 4, "ce": 0}, max_is_ratio=2.0, **wide)
    log_r = [log(3.0), 0.0, log(1.25), log(0.5)]
    kl = [tau * x * x for x in log_r]
    # value and gradient of the policy term use min(r, C) = [2, 1, 1.25, 0.5]; the kl term is untouched
    assert loss == pytest.approx((-(1.0 * 2.0) + 2.0 * 1.0 - 0.5 * 1.25 - 1.0 * 0.5 + sum(kl)) / 4)
    expected = [-1.0 * 2.0, 2.0 * 1.0, -0.5 * 1.25, -1.0 * 0.5]
    assert grad == pytest.approx([(g + 2 * tau * x) / 4 for g, x in zip(expected, log_r)])
    # uncapped, token 0's gradient is -A r = -3: the cap scaled it by C / r = 2/3; the others are unchanged
    _, uncapped, _ = run(lp, lp_inf, rl=rl, scales={"rl": 4, "ce": 0}, **wide)
    assert uncapped[0] == pytest.approx((-3.0 + 2 * tau * log(3.0)) / 4) and uncapped[1:] == pytest.approx(grad[1:])

    assert metrics["mismatch/is_capped_fraction"] == pytest.approx(1 / 4)
    assert metrics["mismatch/mean_abs_logprob_diff"] == pytest.approx((log(3.0) + log(1.25) + log(2.0)) / 4)
    assert metrics["mismatch/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in log_r) / 4)
    assert metrics["trust_region_masked"] == 0.0


def test_capped_tokens_still_leave_through_the_trust_region():
    # r = 3 > C but A > 0 and dp = 0.4 > 0.2: dropped from the policy term as without a cap; only kl remains
    _, grad, metrics = run([math.log(0.6)], [math.log(0.2)], rl=([1.0], [T]), max_is_ratio=2.0, dppo={"kl_tau": 0.1})
    assert grad == pytest.approx([2 * 0.1 * math.log(3.0)])
    assert metrics["trust_region_masked"] == 1.0 and metrics["mismatch/is_capped_fraction"] == 1.0


def test_no_cap_or_a_cap_that_never_binds_is_todays_loss_exactly():
    log = math.log
    lp = [log(0.9), log(0.2), log(0.9), log(0.5), -3.0]
    lp_inf = [log(0.5), log(0.6), log(0.5), log(0.4), -2.0]
    rl = ([1.0, -1.0, -1.0, 1.0, 0.7], [T, T, T, T, T])
    base = run(lp, lp_inf, rl=rl, scales={"rl": 5, "ce": 0}, dppo={"kl_tau": 0.1})
    assert LossConfig().max_is_ratio is None
    for cap in (None, 10.0):
        loss, grad, metrics = run(lp, lp_inf, rl=rl, scales={"rl": 5, "ce": 0}, dppo={"kl_tau": 0.1}, max_is_ratio=cap)
        assert loss == base[0] and grad == base[1]  # bitwise, also when the cap's arithmetic runs
        assert metrics["mismatch/is_capped_fraction"] == 0.0


def test_capped_ratio_stays_finite_where_the_ratio_underflows_or_overflows():
    # r = exp(-200) = 0 and exp(+200) = inf in float32: the capped term is 0 and C, with gradients -A * min(r, C)
    loss, grad, _ = run([-201.0, -1.0], [-1.0, -201.0], rl=([1.0, 1.0], [T, T]), max_is_ratio=2.0,
                        dppo={"kl_tau": 0.0, "mask_high": 2.0})
    assert loss == pytest.approx(-2.0) and grad == pytest.approx([0.0, -2.0])


def test_trust_region_bounds_are_configurable():
    log = math.log
    # dp = 0.4: dropped at the default high bound 0.2, kept at 0.5
    _, grad, metrics = run([log(0.9)], [log(0.5)], rl=([1.0], [T]), dppo={"mask_high": 0.5, "kl_tau": 0.0})
    assert grad == pytest.approx([-1.8]) and metrics["trust_region_masked"] == 0.0


def test_ce_alone():
    loss, grad, metrics = run([-1.0, -2.0, -3.0], [0.0] * 3, ce=([1.0, 0.5, 2.0], [T, F, T]), scales={"rl": 0, "ce": 4})
    assert loss == pytest.approx((1.0 * 1.0 + 2.0 * 3.0) / 4)
    assert grad == pytest.approx([-1.0 / 4, 0.0, -2.0 / 4])
    assert metrics["loss/rl"] == 0.0 and metrics["tokens/ce"] == 2


def test_rl_and_ce_on_one_sequence_use_their_own_scales():
    log, tau = math.log, 0.5
    lp = [log(0.5), log(0.3), -1.5, -0.5]
    lp_inf = [log(0.5), log(0.4), 0.0, 0.0]
    rl = ([2.0, -1.0, 0.0, 0.0], [T, T, F, F])
    ce = ([0.0, 0.0, 1.0, 3.0], [F, F, T, T])
    loss, grad, metrics = run(lp, lp_inf, rl=rl, ce=ce, scales={"rl": 4, "ce": 8}, dppo={"kl_tau": tau})
    log_r1 = log(0.3 / 0.4)
    rl_sum = -2.0 * 1.0 + 1.0 * 0.75 + tau * log_r1**2
    ce_sum = 1.0 * 1.5 + 3.0 * 0.5
    assert loss == pytest.approx(rl_sum / 4 + ce_sum / 8)
    assert grad == pytest.approx([-2.0 / 4, (0.75 + 2 * tau * log_r1) / 4, -1.0 / 8, -3.0 / 8])
    assert metrics["loss/rl"] == pytest.approx(rl_sum / 4) and metrics["loss/ce"] == pytest.approx(ce_sum / 8)
    assert metrics["tokens/rl"] == 2 and metrics["tokens/ce"] == 2


def test_no_masked_token_gives_zero_loss_and_zero_gradient():
    lp = torch.tensor([-1.0, -40.0], requires_grad=True)
    channels = {"rl": (torch.tensor([3.0, 1.0]), torch.tensor([F, F])), "ce": (torch.ones(2), torch.tensor([F, F]))}
    # scales of 0 (no token anywhere in the step) are clamped to 1; lp_inf far away must not overflow exp
    loss, _ = compute_loss(lp, torch.tensor([0.0, 60.0]), channels, {"rl": 0, "ce": 0}, LossConfig())
    loss.backward()
    assert loss.item() == 0.0
    assert lp.grad is not None and lp.grad.tolist() == [0.0, 0.0]
