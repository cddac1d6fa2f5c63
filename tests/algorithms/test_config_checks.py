import pytest

from trace_rl.config import ConfigError
from trace_rl.runs.loading import validate_config


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
    with pytest.raises(ConfigError, match="echo filter 'nowhere.module:fn': module 'nowhere.module' was not found on sys.path"):
        config([{"id": "echo", "filter": {"import_path": "nowhere.module:fn"}}])


def test_unknown_algorithm_lists_the_builtins():
    builtins = "echo, grpo, hierarchical_grpo, max_rl, opd, opsd, rae, reinforce_pp, rl, rloo, sft"
    with pytest.raises(ConfigError, match=builtins):
        config(["ppo"])


BROKEN_MODULES = {
    # a dependency of the module is missing
    "algos_missing_dep": ("import trace_rl_no_such_dependency\n", "No module named 'trace_rl_no_such_dependency'"),
    # the module raises ImportError itself (e.g. an optional backend it cannot use)
    "algos_raising": ("raise ImportError('needs the CUDA build of somelib')\n", "needs the CUDA build of somelib"),
}


@pytest.mark.parametrize("module", sorted(BROKEN_MODULES))
def test_an_algorithm_module_that_fails_to_import_is_that_error_not_an_unknown_or_remote_one(
        module, tmp_path, monkeypatch):
    from trace_rl.algorithms.base import AlgorithmError
    from trace_rl.algorithms.lookup import load_algorithm
    from trace_rl.config import AlgorithmConfig, EnvConfig
    from trace_rl.remote.client import remote_server_for

    source, original = BROKEN_MODULES[module]
    (tmp_path / f"{module}.py").write_text(source + "from trace_rl.algorithms.base import Algorithm\n"
                                           "class MyAlgo(Algorithm):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    algorithm_id = f"{module}:MyAlgo"
    expected = f"algorithm '{algorithm_id}': importing module '{module}' failed: .*{original}"
    for server in (None, "http://127.0.0.1:9"):  # with an env server too: never sent there
        with pytest.raises(ConfigError, match=expected) as info:
            validate_config({"name": "run", "env": [{"id": "reverse-text", "server": server}],
                             "algorithms": [algorithm_id]})
        assert "unknown algorithm" not in str(info.value)
    with pytest.raises(AlgorithmError, match=expected):
        remote_server_for(EnvConfig(id="reverse-text", server="http://127.0.0.1:9"), AlgorithmConfig(id=algorithm_id))
    with pytest.raises(AlgorithmError, match=expected):
        load_algorithm(algorithm_id)


def test_a_module_that_is_not_here_goes_to_the_env_server_or_is_named_not_found(tmp_path, monkeypatch):
    from trace_rl.config import AlgorithmConfig, EnvConfig
    from trace_rl.remote.client import remote_server_for

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "algos_pkg").mkdir()
    (tmp_path / "algos_pkg" / "__init__.py").write_text("")
    for algorithm_id in ("trace_rl_nowhere:MyAlgo", "algos_pkg.nowhere:MyAlgo"):
        env = EnvConfig(id="reverse-text", server="http://127.0.0.1:9")
        assert remote_server_for(env, AlgorithmConfig(id=algorithm_id)) == "http://127.0.0.1:9"
        # without a server: refused, saying the module was not found (an import path all the same)
        module = algorithm_id.partition(":")[0]
        with pytest.raises(ConfigError, match=f"algorithm '{algorithm_id}': module '{module}' was not found on "
                                              r"sys.path; run trace-rl from the directory that holds "):
            config([algorithm_id])


def test_a_module_without_the_class_names_the_missing_attribute(tmp_path, monkeypatch):
    (tmp_path / "algos_no_class.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="module 'algos_no_class' has no attribute 'MyAlgo'"):
        config(["algos_no_class:MyAlgo"])
