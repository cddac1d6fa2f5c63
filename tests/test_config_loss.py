"""[trainer.loss]: the policy's keys, the aggregation and the correction are refused where inconsistent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.config import ConfigError, LossConfig, config_to_toml
from trace_rl.runs.loading import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"


def problems(**loss) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config({"name": "run", "env": [{"id": "reverse-text"}], "trainer": {"loss": loss}})
    return info.value.problems


def test_the_default_is_todays_dppo_loss():
    loss = LossConfig()
    assert (loss.policy, loss.aggregation_mode, loss.importance_correction) == ("dppo", "token-mean", None)
    assert (loss.dppo_mask_low, loss.dppo_mask_high, loss.kl_tau, loss.max_is_ratio) == (0.2, 0.2, 1e-3, None)


@pytest.mark.parametrize("loss, expected", [
    ({"policy": "ppo", "kl_tau": 0.01}, "kl_tau is not used by policy = 'ppo' (only by dppo); remove it"),
    ({"policy": "sapo", "clip_low": 0.1}, "clip_low is not used by policy = 'sapo' (only by ppo, gspo, cispo)"),
    ({"clip_c": 3.0}, "clip_c is not used by policy = 'dppo' (only by ppo)"),
    ({"policy": "gspo", "clip_c": 3.0}, "clip_c is not used by policy = 'gspo'"),
    ({"policy": "ppo", "tau_pos": 2.0}, "tau_pos is not used by policy = 'ppo' (only by sapo)"),
    ({"policy": "reinforce", "dppo_mask_high": 0.5}, "dppo_mask_high is not used by policy = 'reinforce'"),
    ({"norm_tokens": 512}, "norm_tokens is used only by aggregation = 'seq-mean-token-sum-norm'"),
    ({"policy": "ppo", "max_is_ratio": 2.0}, "max_is_ratio truncates the importance weight of dppo and reinforce"),
    ({"policy": "cispo", "correction": {"high": 2.0}}, "correction.mode = 'truncate' truncates"),
    ({"max_is_ratio": 2.0, "correction": {"high": 2.0}}, "set one of them"),
    ({"correction": {"low": 0.5, "high": 2.0}}, "low is a bound of mode = 'mask'"),
    ({"correction": {"mode": "mask", "low": 2.0, "high": 2.0}}, "low = 2 must be below high = 2"),
    ({"correction": {"level": "sequence"}}, "trainer.loss.correction.high: required key is missing"),
    ({"policy": "grpo"}, "trainer.loss.policy:"),
])
def test_inconsistent_loss_options_are_refused_naming_the_key(loss, expected):
    found = problems(**loss)
    assert any(expected in p for p in found), found
    assert all(p.startswith("trainer.loss") for p in found)


@pytest.mark.parametrize("loss", [
    {"policy": "ppo", "clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0},
    {"policy": "gspo", "correction": {"level": "sequence", "mode": "mask", "low": 0.5, "high": 2.0}},
    {"policy": "cispo", "aggregation": "seq-mean-token-sum-norm", "norm_tokens": 1024},
    {"policy": "sapo", "tau_pos": 1.0, "tau_neg": 1.05},
    {"policy": "reinforce", "correction": {"level": "geometric", "high": 2.0}},
    {"kl_tau": 0.0, "correction": {"level": "token", "mode": "mask", "low": 0.5, "high": 2.0}},
])
def test_consistent_options_load_and_survive_the_resolved_toml(loss, tmp_path):
    config = validate_config({"name": "run", "env": [{"id": "reverse-text"}], "trainer": {"loss": loss}})
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_a_stored_dppo_config_switches_policy_with_set(tmp_path):
    # a run's config.toml writes dppo's keys at their defaults: --set trainer.loss.policy=ppo still loads
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(load_config(DEMO)))
    assert "kl_tau = 0.001" in path.read_text()
    assert load_config(path, ["trainer.loss.policy=ppo"]).trainer.loss.policy == "ppo"


def test_dry_run_refuses_a_key_the_policy_does_not_use():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(DEMO), "--dry-run", "--set",
                          "trainer.loss.policy=ppo", "--set", "trainer.loss.tau_pos=2"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "trainer.loss: tau_pos is not used by policy = 'ppo' (only by sapo); remove it" in out.stderr


@pytest.mark.parametrize("policy", ["gspo", "sapo"])
def test_gspo_and_sapo_take_any_aggregation_with_one_note_that_the_paper_aggregates_per_sequence(policy):
    assert LossConfig(policy=policy).notes == []
    assert LossConfig(policy=policy, aggregation="seq-mean-token-mean").notes == []
    for aggregation in ("token-mean", "seq-mean-token-sum"):
        (note,) = LossConfig(policy=policy, aggregation=aggregation).notes
        assert f"policy = '{policy}' with aggregation = '{aggregation}'" in note and "per sequence" in note
    assert LossConfig(policy="ppo", aggregation="token-mean").notes == []
