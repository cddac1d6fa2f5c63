import pytest

from trace_rl.config import ConfigError
from trace_rl.loading import validate_config


def config(algorithms, actor="policy", models=None):
    return validate_config({"name": "run", "env": [{"id": "reverse-text"}], "actor": actor, "algorithms": algorithms,
                            "models": models or {}})


REFERENCE = {"reference": {"name": "tiny:1", "tokens": True}}


def test_sft_requires_a_non_policy_actor():
    with pytest.raises(ConfigError, match="'sft'.*actor = 'policy' teaches it nothing"):
        config(["sft"])
    assert config(["sft"], actor="reference", models=REFERENCE).actor == "reference"


def test_rl_loss_with_a_non_policy_actor_is_rejected():
    with pytest.raises(ConfigError, match="'grpo' has loss 'rl'"):
        config(["sft", "grpo"], actor="reference", models=REFERENCE)


def test_opd_model_must_exist_and_be_token_capable():
    with pytest.raises(ConfigError, match=r"'opd': model 'reference' is not configured.*\[models.reference\]"):
        config(["opd"])
    with pytest.raises(ConfigError, match="models.teacher must set tokens = true"):
        config([{"id": "opd", "model": "teacher"}], models={"teacher": {"name": "tiny:1"}})
    assert config(["opd", "grpo"], models=REFERENCE).algorithms[0].id == "opd"


def test_opsd_defaults_to_the_policy_as_teacher():
    assert config(["opsd"]).algorithms[0].id == "opsd"
    with pytest.raises(ConfigError, match="'opsd': model 'judge' is not configured"):
        config([{"id": "opsd", "model": "judge"}])


def test_echo_filter_must_be_importable_at_config_time():
    with pytest.raises(ConfigError, match="echo filter 'nowhere.module:fn' cannot be imported"):
        config([{"id": "echo", "filter": {"import_path": "nowhere.module:fn"}}])


def test_unknown_algorithm_lists_the_builtins():
    with pytest.raises(ConfigError, match="echo, grpo, max_rl, opd, opsd, rae, rl, sft"):
        config(["ppo"])
