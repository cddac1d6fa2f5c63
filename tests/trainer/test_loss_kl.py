"""[trainer.loss.kl]: the estimators k1, k2, k3, k3+ against hand-computed values and gradients, the KL term of
compute_loss, the batch column, and the config's refusals (docs/trainer.md)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trace_rl.config import ConfigError, KLConfig, LossConfig
from trace_rl.data.sample import TrainingSample
from trace_rl.runs.loading import validate_config
from trace_rl.tables import samples_to_table, table_to_samples
from trace_rl.trainer.loss import compute_loss, kl_estimate
from trace_rl.trainer.packing import pack

ROOT = Path(__file__).resolve().parents[2]
E = math.e

# d = lp - lp_ref = 0.5, 0, -1
LP = [-1.0, -0.5, -2.0]
LP_REF = [-1.5, -0.5, -1.0]
EXPECTED = {  # (values, d value / d lp) by hand
    "k1": ([0.5, 0.0, -1.0], [1.0, 1.0, 1.0]),
    "k2": ([0.125, 0.0, 0.5], [0.5, 0.0, -1.0]),
    # exp(-d) - 1 + d;  1 - exp(-d)
    "k3": ([math.exp(-0.5) - 0.5, 0.0, E - 2], [1 - math.exp(-0.5), 0.0, 1 - E]),
    # k3's values, k2's gradient
    "k3+": ([math.exp(-0.5) - 0.5, 0.0, E - 2], [0.5, 0.0, -1.0]),
}


@pytest.mark.parametrize("estimator", list(EXPECTED))
def test_estimator_values_and_gradients_by_hand(estimator):
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    lp_ref = torch.tensor(LP_REF, dtype=torch.float64, requires_grad=True)
    value = kl_estimate(lp, lp_ref, estimator)
    value.sum().backward()
    values, grads = EXPECTED[estimator]
    assert value.detach().tolist() == pytest.approx(values, abs=1e-12)
    assert lp.grad.tolist() == pytest.approx(grads, abs=1e-12)
    assert lp_ref.grad is None  # the reference is a constant


def test_k3_is_nonnegative_and_k1_k3_agree_in_expectation_on_samples():
    # sampled from pi = N(0,1)-ish categorical: E_pi[k1] = E_pi[k3] = KL(pi || ref), both estimate it
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    lp, lp_ref = probs.log(), ref.log()
    kl = float((probs * (lp - lp_ref)).sum())
    for estimator in ("k1", "k3"):
        assert float((probs * kl_estimate(lp, lp_ref, estimator)).sum()) == pytest.approx(kl, abs=1e-12)
    assert bool((kl_estimate(lp, lp_ref, "k3") >= 0).all())


def loss_config(**kl) -> LossConfig:
    return LossConfig(kl=KLConfig(**{"coef": 0.1, "estimator": "k3", **kl}))


def test_compute_loss_adds_coef_times_the_estimate_over_rl_tokens_only():
    lp = torch.tensor([0.0, -1.0, -0.5, -2.0], requires_grad=True)
    lp_inf = lp.detach().clone()  # on-policy, zero advantages: the rl loss and its gradient are 0
    lp_ref = torch.tensor([0.0, -1.5, -0.5, float("nan")])  # never read where the rl mask is false
    rl_mask = torch.tensor([False, True, True, False])
    no = torch.zeros(4, dtype=torch.bool)
    channels = {"rl": (torch.zeros(4), rl_mask), "ce": (torch.zeros(4), no)}
    loss, metrics = compute_loss(lp, lp_inf, channels, {"rl": 2, "ce": 0}, loss_config(), lp_ref=lp_ref)
    loss.backward()
    k3 = math.exp(-0.5) - 0.5  # d = 0.5 on token 1, 0 on token 2
    assert float(loss.detach()) == pytest.approx(0.1 * k3 / 2, abs=1e-7)
    assert float(metrics["loss/kl"]) == pytest.approx(0.1 * k3 / 2, abs=1e-7)
    assert float(metrics["loss/rl"]) == 0.0
    assert lp.grad.tolist() == pytest.approx([0.0, 0.1 * (1 - math.exp(-0.5)) / 2, 0.0, 0.0], abs=1e-7)


def test_the_kl_term_follows_the_aggregation():
    lp = torch.tensor([0.0, -1.0, -1.0, 0.0, -2.0])
    lp_ref = torch.tensor([0.0, -2.0, -2.0, 0.0, -1.0])  # d = 1, 1 | -1
    mask = torch.tensor([False, True, True, False, True])
    channels = {"rl": (torch.zeros(5), mask), "ce": (torch.zeros(5), torch.zeros(5, dtype=torch.bool))}
    scales = {"rl": 3, "ce": 0, "rl_sequences": 2, "ce_sequences": 0}
    config = LossConfig(aggregation="seq-mean-token-mean", kl=KLConfig(coef=1.0, estimator="k1"))
    _, metrics = compute_loss(lp, lp, channels, scales, config, sequence_lengths=[3, 2], lp_ref=lp_ref)
    assert float(metrics["loss/kl"]) == pytest.approx((1.0 + -1.0) / 2)  # sequence means 1 and -1, averaged


def test_without_kl_nothing_changes_and_kl_without_lp_ref_fails():
    lp = torch.tensor([0.0, -1.0])
    channels = {"rl": (torch.ones(2), torch.tensor([False, True])), "ce": (torch.zeros(2), torch.zeros(2, dtype=bool))}
    _, metrics = compute_loss(lp, lp, channels, {"rl": 1, "ce": 0}, LossConfig())
    assert "loss/kl" not in metrics
    with pytest.raises(ValueError, match="no ref_logprobs"):
        compute_loss(lp, lp, channels, {"rl": 1, "ce": 0}, loss_config())


def sample(n: int, ref: bool) -> TrainingSample:
    f, b = np.zeros(n, np.float32), np.ones(n, np.bool_)
    return TrainingSample(trace_id="t", branch_index=0, env="e", input_ids=np.arange(n, dtype=np.int32),
                          temperature=1.0, sampled=b, inference_logprobs=f, rl_values=f, rl_mask=b, ce_values=f,
                          ce_mask=~b, ref_logprobs=np.linspace(-1, 0, n, dtype=np.float32) if ref else None)


def test_the_batch_carries_ref_logprobs_only_with_a_reference():
    assert "ref_logprobs" not in samples_to_table([sample(3, False)]).column_names
    table = samples_to_table([sample(3, True), sample(2, True)])
    assert str(table.schema.field("ref_logprobs").type) == "list<item: float>"
    back = table_to_samples(table)
    assert back[0].ref_logprobs.tolist() == pytest.approx([-1.0, -0.5, 0.0])
    assert table_to_samples(samples_to_table([sample(3, False)]))[0].ref_logprobs is None
    batches = pack(back, 8)
    assert batches[0].ref_logprobs.tolist() == pytest.approx([-1.0, -0.5, 0.0, -1.0, 0.0])
    with pytest.raises(ValueError, match="or none does"):
        samples_to_table([sample(3, True), sample(2, False)])


def config_problems(**data) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config({"name": "run", "env": [{"id": "reverse-text"}], **data})
    return info.value.problems


@pytest.mark.parametrize("data, expected", [
    ({"trainer": {"loss": {"kl": {}}}}, "'reference' is not a model (models: none); add [models.reference] with "
     "tokens = true"),
    ({"trainer": {"loss": {"kl": {"model": "ref"}}}, "models": {"ref": {"name": "tiny"}}},
     "models.ref must set tokens = true"),
    ({"trainer": {"loss": {"kl": {"model": "policy"}}}}, "'policy' is the trained model itself"),
    ({"trainer": {"loss": {"kl": {"estimator": "k4"}}}}, "trainer.loss.kl.estimator"),
    ({"trainer": {"loss": {"kl": {"coef": 0}}}}, "trainer.loss.kl.coef"),
])
def test_kl_without_a_token_capable_reference_is_refused(data, expected):
    found = config_problems(**data)
    assert any(expected in p for p in found), found


def test_kl_with_a_reference_loads():
    config = validate_config({"name": "run", "env": [{"id": "reverse-text"}],
                              "models": {"reference": {"name": "tiny", "tokens": True}},
                              "trainer": {"loss": {"kl": {"coef": 0.05, "estimator": "k3+"}}}})
    assert config.trainer.loss.kl == KLConfig(model="reference", coef=0.05, estimator="k3+")


def test_dry_run_refuses_kl_without_the_model():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(ROOT / "configs" / "demo.toml"),
                          "--dry-run", "--set", "trainer.loss.kl.coef=0.01"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "trainer.loss.kl.model: 'reference' is not a model" in out.stderr, out.stderr
