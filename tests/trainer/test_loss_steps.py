"""[trainer.loss] variants through the trainer: a step's loss does not depend on packing (nor on the number of ranks:
tests/trainer/test_trainer.py::test_gloo_workers_match_one_process trains SEQUENCE_LOSS on two ranks)."""

from __future__ import annotations

import pytest

from tests.trainer.conftest import make_batch, storage_for
from trace_rl.trainer.trainer import Trainer, resolved_loss_config

SEQUENCE_LOSS = {"policy": "ppo", "ppo": {"clip_c": 3.0}, "aggregation": "seq-mean-token-sum"}
VARIANTS = [
    {"aggregation": "seq-mean-token-mean"},
    SEQUENCE_LOSS,
    {"policy": "reinforce", "aggregation": "seq-mean-token-sum-norm",
     "correction": {"level": "sequence", "mode": "mask", "low": 0.05, "high": 20.0}},
]


@pytest.mark.parametrize("loss", VARIANTS)
def test_one_or_several_micro_batches_give_the_same_step(make_config, loss):
    one = make_config("one", micro_batch_tokens=4096, loss=loss)
    several = make_config("several", micro_batch_tokens=48, loss=loss)
    a = Trainer(one, storage_for(one)).optimizer_step(0, make_batch(7))
    b = Trainer(several, storage_for(several)).optimizer_step(0, make_batch(7))
    assert a["micro_batches"] == 1 and b["micro_batches"] >= 3
    for name in ("loss", "loss/rl", "loss/ce", "grad_norm", "mismatch/token_ratio_mean", "mismatch/seq_ratio_max"):
        assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-7), name


def test_another_policy_trains_differently_on_the_same_batch(make_config):
    steps = {policy: Trainer(c, storage_for(c)).optimizer_step(0, make_batch(7))
             for policy in ("dppo", "cispo") for c in [make_config(policy, loss={"policy": policy})]}
    assert steps["dppo"]["grad_norm"] != pytest.approx(steps["cispo"]["grad_norm"], rel=1e-3)
    assert steps["dppo"]["trust_region_masked"] >= 0 and steps["cispo"]["trust_region_masked"] == 0.0


def test_norm_tokens_defaults_to_the_largest_max_completion_tokens(make_config):
    config = make_config(loss={"aggregation": "seq-mean-token-sum-norm"})
    config.sampling.max_completion_tokens = 32
    assert resolved_loss_config(config).norm_tokens == 32
    assert config.trainer.loss.norm_tokens is None  # the run's config is left as written
