"""A policy loss of your own (docs/trainer.md, "A loss of your own"): configs/losses/topr.py as the docs show it,
its gradient through `compute_loss` against its formula under other aggregations and a correction, and what the
registry refuses."""

from __future__ import annotations

import math
import re
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from pydantic import BaseModel

import configs.losses.topr  # noqa: F401  (registers "topr", as a config's `imports` does)
from tests.trainer.test_loss import T, run
from trace_rl.config import LossConfig
from trace_rl.losses import LOSSES, LossError, register_loss
from trace_rl.trainer.loss import compute_loss

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_show_the_loss_as_the_repository_has_it():
    doc = (ROOT / "docs" / "trainer.md").read_text()
    code = re.search(r"```python\n# configs/losses/topr.py\n(.*?)```", doc, re.S).group(1)
    assert code == (ROOT / "configs" / "losses" / "topr.py").read_text()
    assert 'imports = ["configs.losses.topr"]' in doc and 'imports = ["configs.losses.topr"]' in (
        ROOT / "configs" / "topr.toml").read_text()


# r = [1.5, 0.5, 2, 0.5], A = [1, 1, -1, -1]: topr's weights min(r, cap) where A < 0, else 1; d l_t / d lp_t = -w_t A_t
LP = [math.log(0.15), math.log(0.05), math.log(0.2), math.log(0.05)]
LP_INF = [math.log(0.1)] * 4
RL = ([1.0, 1.0, -1.0, -1.0], [T] * 4)
TOKENS = {"rl": 4, "ce": 0, "rl_sequences": 2, "ce_sequences": 0}


@pytest.mark.parametrize("loss, lengths, weights, divisors, clipped", [
    # token-mean: each token over the 4 rl tokens; t2 (A < 0, r = 2 > 1) is clipped to weight 1
    ({}, [4], [1.0, 1.0, 1.0, 0.5], [4] * 4, 1),
    ({"topr": {"negative_cap": 1.5}}, [4], [1.0, 1.0, 1.5, 0.5], [4] * 4, 1),
    # seq-mean-token-mean over sequences [t0] and [t1, t2, t3]: t0 / (1 * 2), the others / (3 * 2)
    ({"aggregation": "seq-mean-token-mean"}, [1, 3], [1.0, 1.0, 1.0, 0.5], [2, 6, 6, 6], 1),
    # a masking correction (w outside [0.4, 1.8] leaves): t2 leaves the loss, its count stays in N
    ({"correction": {"mode": "mask", "low": 0.4, "high": 1.8}}, [4], [1.0, 1.0, 0.0, 0.5], [4] * 4, 0),
])
def test_topr_through_compute_loss_has_the_gradient_of_its_formula(loss, lengths, weights, divisors, clipped):
    total, grad, metrics = run(LP, LP_INF, rl=RL, scales=TOKENS, lengths=lengths, policy="topr", **loss)
    advantages = RL[0]
    assert grad == pytest.approx([-w * a / d for w, a, d in zip(weights, advantages, divisors)], abs=1e-7)
    assert total == pytest.approx(sum(-w * a * x / d for w, a, x, d in zip(weights, advantages, LP, divisors)))
    assert metrics["clipped_fraction"] == pytest.approx(clipped / 4)
    assert metrics["trust_region_masked"] == 0.0


def test_a_loss_name_options_and_result_are_refused_where_wrong():
    class Loose(BaseModel):
        value: float = 1.0

    with pytest.raises(LossError, match="loss name 'kl' is a key of \\[trainer.loss\\] itself"):
        register_loss("kl")
    with pytest.raises(LossError, match="its options model Loose must refuse unknown keys"):
        register_loss("loose", Loose)
    with pytest.raises(LossError, match="loss name 'ppo' is already registered by trace_rl.losses.builtin.ppo"):
        register_loss("ppo")(lambda tokens, options: tokens.lp)
    with patch.dict(LOSSES):  # the registry as it was, after the test
        register_loss("mean_only")(lambda tokens, options: -(tokens.advantages * tokens.lp).mean())
        channels = {"rl": (torch.ones(3), torch.ones(3, dtype=torch.bool)),
                    "ce": (torch.zeros(3), torch.zeros(3, dtype=torch.bool))}
        with pytest.raises(LossError, match=r"policy loss 'mean_only' returned \(\): it must return one loss per "
                                            r"token, a tensor of shape \(3,\)"):
            compute_loss(torch.zeros(3), torch.zeros(3), channels, {"rl": 3, "ce": 0}, LossConfig(policy="mean_only"))
    assert "mean_only" not in LOSSES
