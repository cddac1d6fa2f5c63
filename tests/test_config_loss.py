"""[trainer.loss]: the policy loss and its own table, the aggregation and the correction are refused where
inconsistent, and the flat keys of old name their new place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.config import ConfigError, LossConfig, config_to_toml
from trace_rl.losses import loss_notes, resolve_loss
from trace_rl.losses.builtin import PPOOptions
from trace_rl.runs.loading import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"


def problems(**loss) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config({"name": "run", "env": [{"id": "reverse-text"}], "trainer": {"loss": loss}})
    return info.value.problems


def test_the_default_is_todays_dppo_loss():
    loss = LossConfig()
    policy, options, aggregation = resolve_loss(loss)
    assert (policy.name, aggregation, loss.importance_correction) == ("dppo", "token-mean", None)
    assert (options.mask_low, options.mask_high, options.kl_tau, loss.max_is_ratio) == (0.2, 0.2, 1e-3, None)


def test_each_policy_reads_its_own_table_with_its_own_defaults():
    assert resolve_loss(LossConfig(policy="ppo"))[1] == PPOOptions(clip_low=0.2, clip_high=0.2, clip_c=None)
    assert resolve_loss(LossConfig(policy="ppo", ppo={"clip_high": 0.28}))[1].clip_high == 0.28
    _, gspo, aggregation = resolve_loss(LossConfig(policy="gspo"))
    assert (gspo.clip_low, gspo.clip_high, aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert resolve_loss(LossConfig(policy="sapo", aggregation="token-mean"))[2] == "token-mean"


@pytest.mark.parametrize("loss, expected", [
    ({"policy": "ppo", "ppo": {"kl_tau": 0.01}},
     "trainer.loss.ppo.kl_tau: unknown key (known keys: clip_low, clip_high, clip_c)"),
    ({"policy": "sapo", "sapo": {"clip_low": 0.1}}, "trainer.loss.sapo.clip_low: unknown key (known keys: tau_pos, "
     "tau_neg)"),
    ({"ppo": {"clip_c": 3.0}}, "trainer.loss.ppo: the options of policy 'ppo', but policy = 'dppo'; remove "
     "[trainer.loss.ppo] or set policy = 'ppo'"),
    ({"policy": "reinforce", "reinforce": {"mask_high": 0.5}},
     "trainer.loss.reinforce.mask_high: unknown key (known keys: none)"),
    ({"policy": "ppo", "ppo": {"clip_c": 0.5}}, "trainer.loss.ppo.clip_c: Input should be greater than 1"),
    ({"grpo": {"alpha": 1}}, "trainer.loss.grpo: unknown key (known keys: policy, aggregation, norm_tokens, "
     "max_is_ratio, correction, kl, dppo)"),
    ({"norm_tokens": 512}, "trainer.loss.norm_tokens: used only by aggregation = 'seq-mean-token-sum-norm'"),
    ({"policy": "ppo", "max_is_ratio": 2.0}, "max_is_ratio truncates the importance weight of dppo, reinforce"),
    ({"policy": "cispo", "correction": {"high": 2.0}}, "correction.mode = 'truncate' truncates"),
    ({"max_is_ratio": 2.0, "correction": {"high": 2.0}}, "set one of them"),
    ({"correction": {"low": 0.5, "high": 2.0}}, "low is a bound of mode = 'mask'"),
    ({"correction": {"mode": "mask", "low": 2.0, "high": 2.0}}, "low = 2 must be below high = 2"),
    ({"correction": {"level": "sequence"}}, "trainer.loss.correction.high: required key is missing"),
    ({"policy": "grpo"}, "trainer.loss.policy: unknown loss 'grpo'; registered: cispo, dppo, gspo, ppo, reinforce, "
     "sapo"),  # then any loss another test of the session registered, and how to register one
])
def test_inconsistent_loss_options_are_refused_naming_the_key(loss, expected):
    found = problems(**loss)
    assert any(expected in p for p in found), found
    assert all(p.startswith("trainer.loss") for p in found)


@pytest.mark.parametrize("old, new", [
    ({"kl_tau": 0.01}, "trainer.loss.kl_tau: moved to [trainer.loss.dppo] kl_tau"),
    ({"dppo_mask_low": 0.1}, "trainer.loss.dppo_mask_low: moved to [trainer.loss.dppo] mask_low"),
    ({"dppo_mask_high": 0.1}, "trainer.loss.dppo_mask_high: moved to [trainer.loss.dppo] mask_high"),
    ({"policy": "gspo", "clip_low": 0.1}, "trainer.loss.clip_low: moved to [trainer.loss.gspo] clip_low"),
    ({"clip_high": 0.28}, "trainer.loss.clip_high: moved to [trainer.loss.ppo] clip_high (likewise "
     "[trainer.loss.gspo], [trainer.loss.cispo])"),
    ({"policy": "ppo", "clip_c": 3.0}, "trainer.loss.clip_c: moved to [trainer.loss.ppo] clip_c"),
    ({"tau_pos": 1.0}, "trainer.loss.tau_pos: moved to [trainer.loss.sapo] tau_pos"),
    ({"tau_neg": 1.0}, "trainer.loss.tau_neg: moved to [trainer.loss.sapo] tau_neg"),
])
def test_a_flat_key_of_old_is_one_line_naming_its_new_place(old, new):
    assert problems(**old) == [new]


@pytest.mark.parametrize("loss", [
    {"policy": "ppo", "ppo": {"clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0}},
    {"policy": "gspo", "correction": {"level": "sequence", "mode": "mask", "low": 0.5, "high": 2.0}},
    {"policy": "cispo", "aggregation": "seq-mean-token-sum-norm", "norm_tokens": 1024},
    {"policy": "sapo", "sapo": {"tau_pos": 1.0, "tau_neg": 1.05}},
    {"policy": "reinforce", "correction": {"level": "geometric", "high": 2.0}},
    {"dppo": {"kl_tau": 0.0}, "correction": {"level": "token", "mode": "mask", "low": 0.5, "high": 2.0}},
])
def test_consistent_options_load_and_survive_the_resolved_toml(loss, tmp_path):
    config = validate_config({"name": "run", "env": [{"id": "reverse-text"}], "trainer": {"loss": loss}})
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_a_stored_config_switches_policy_with_set(tmp_path):
    # a run's config.toml records the loss tables it was given, none by default: --set trainer.loss.policy=ppo loads
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(load_config(DEMO)))
    assert "[trainer.loss]" in path.read_text() and "dppo" in path.read_text()
    assert load_config(path, ["trainer.loss.policy=ppo"]).trainer.loss.policy == "ppo"


def test_dry_run_refuses_an_old_flat_key_and_a_key_the_policy_does_not_have():
    def dry_run(*overrides):
        sets = [arg for override in overrides for arg in ("--set", override)]
        return subprocess.run([sys.executable, "-m", "flows.cli", "train", str(DEMO), "--dry-run", *sets],
                              capture_output=True, text=True, cwd=ROOT)

    out = dry_run("trainer.loss.policy=sapo", "trainer.loss.tau_pos=2")
    assert out.returncode == 2, out.stderr
    assert out.stderr == "error: trainer.loss.tau_pos: moved to [trainer.loss.sapo] tau_pos\n"
    out = dry_run("trainer.loss.policy=ppo", "trainer.loss.ppo.tau_pos=2")
    assert out.returncode == 2, out.stderr
    assert "trainer.loss.ppo.tau_pos: unknown key (known keys: clip_low, clip_high, clip_c)" in out.stderr


@pytest.mark.parametrize("policy", ["gspo", "sapo"])
def test_gspo_and_sapo_take_any_aggregation_with_one_note_that_the_paper_aggregates_per_sequence(policy):
    assert loss_notes(LossConfig(policy=policy)) == []
    assert loss_notes(LossConfig(policy=policy, aggregation="seq-mean-token-mean")) == []
    for aggregation in ("token-mean", "seq-mean-token-sum"):
        (note,) = loss_notes(LossConfig(policy=policy, aggregation=aggregation))
        assert f"policy = '{policy}' with aggregation = '{aggregation}'" in note and "per sequence" in note
    assert loss_notes(LossConfig(policy="ppo", aggregation="token-mean")) == []
