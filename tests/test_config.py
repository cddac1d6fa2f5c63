import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.config import ConfigError
from trace_rl.runs.loading import load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"


def minimal(**extra):
    return {"name": "run", "env": [{"id": "reverse-text"}], **extra}


def problems(data) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(data)
    return info.value.problems


def test_demo_config_loads_with_typed_overrides():
    config = load_config(DEMO, ["trainer.lr=1e-5", "env.0.group_size=4", "name=other", "sampling.temperature=0.7"])
    assert config.trainer.lr == 1e-5
    assert config.env[0].group_size == 4
    assert config.name == "other"
    assert config.sampling.temperature == 0.7
    assert [a.id for a in config.algorithms_for(config.env[0])] == ["grpo"]


def test_every_wrong_key_is_named_with_a_fix():
    found = problems(minimal(env=[{"id": "reverse-text", "group_sze": 3}], trainer={"lrr": 1, "loss": {"kl_taus": 1}}))
    assert "env.0.group_sze: unknown key; did you mean 'group_size'?" in found
    assert "trainer.lrr: unknown key; did you mean 'lr'?" in found
    assert any(p.startswith("trainer.loss.kl_taus: unknown key") and "kl_tau" in p for p in found)
    assert len(found) == 3


def test_wrong_types_and_missing_keys():
    found = problems({"env": [{"id": "reverse-text"}], "trainer": {"lr": "fast"}})
    assert "name: required key is missing; add it" in found
    assert any(p.startswith("trainer.lr:") and "'fast'" in p for p in found)


def test_a_value_that_fits_no_member_of_a_union_is_one_problem_at_its_key():
    found = problems(minimal(trainer={"compile": "maybe"}, models={"ref": {"name": "tiny", "base_url": 3}}))
    assert sorted(found) == [
        "models.ref.base_url: Input should be a valid string or a valid list (got 3)",
        "trainer.compile: Input should be 'auto' or a valid boolean, unable to interpret input (got 'maybe')"]
    # a key that looks like a type name is still the key
    assert problems(minimal(trainer={"max-lr": 1}))[0].startswith("trainer.max-lr: unknown key")
    assert problems(minimal(models={"my-ref": 3}))[0].startswith("models.my-ref: Input should be a valid dictionary")


def test_policy_key_is_reserved_and_actor_must_be_token_capable():
    assert any("reserved" in p for p in problems(minimal(models={"policy": {"name": "tiny"}})))
    assert any("actor: 'ref' is not a model" in p for p in problems(minimal(actor="ref")))
    found = problems(minimal(actor="reference", algorithms=["sft"], models={"reference": {"name": "tiny:1"}}))
    assert any("tokens = true" in p for p in found)


def test_unknown_algorithm_lists_known_ids_unless_env_has_server():
    found = problems(minimal(algorithms=["nope"]))
    assert any("unknown algorithm 'nope'" in p and "grpo" in p for p in found)
    config = validate_config(minimal(algorithms=["grpo"], env=[{"id": "reverse-text", "server": "http://127.0.0.1:1", "algorithms": ["nope"]}]))
    assert config.env[0].algorithms[0].id == "nope"


def test_env_algorithms_replace_the_default_list():
    config = validate_config(minimal(algorithms=["grpo"], env=[{"id": "reverse-text", "algorithms": ["rl", {"id": "echo"}]},
                                                                   {"id": "alphabet-sort"}]))
    assert [a.id for a in config.algorithms_for(config.env[0])] == ["rl", "echo"]
    assert [a.id for a in config.algorithms_for(config.env[1])] == ["grpo"]


def test_env_ids_and_args_are_checked_at_config_time():
    found = problems(minimal(env=[{"id": "nope"}, {"id": "reverse-text", "args": {"min_lenght": 2}},
                                  {"id": "reverse-text", "args": {"min_length": 9, "max_length": 4}}]))
    assert found[0].startswith("env.0: unknown env id 'nope'; use a builtin (") and "reverse-text" in found[0]
    assert found[1].startswith("env.1: env 'reverse-text': args.min_lenght: unknown key (known keys: min_length")
    assert found[2] == "env.2: env 'reverse-text': args: min_length 9 > max_length 4"
    assert len(found) == 3


def test_set_into_a_value_names_the_key():
    with pytest.raises(ConfigError, match=r"--set trainer.lr.x: trainer.lr is a value, not a table or list"):
        load_config(DEMO, ["trainer.lr.x=1"])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_dry_run_prints_resolved_config_without_torch_or_vllm():
    probe = "import sys, flows.cli as c; rc = c.main(sys.argv[1:]); " \
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'dry run imported torch/vllm'; sys.exit(rc)"
    out = subprocess.run([sys.executable, "-c", probe, "train", str(DEMO), "--dry-run", "--set", "trainer.lr=2e-5"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "lr = 2e-05" in out.stdout and 'name = "demo"' in out.stdout


def test_dry_run_reprint_is_a_valid_equal_config(tmp_path):
    from trace_rl.config import config_to_toml

    config = load_config(DEMO)
    path = tmp_path / "resolved.toml"
    path.write_text(config_to_toml(config))
    assert load_config(path) == config


def test_bad_config_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(DEMO.read_text().replace("group_size = 8", "group_sise = 8"))
    out = _cli("train", str(bad), "--dry-run")
    assert out.returncode == 2
    assert "env.0.group_sise: unknown key; did you mean 'group_size'?" in out.stderr


def test_config_schema_is_json_with_the_contract_keys():
    import json

    out = _cli("config-schema")
    schema = json.loads(out.stdout)
    for key in ("name", "steps", "seed", "storage", "actor", "algorithms", "model", "models", "env", "trainer"):
        assert key in schema["properties"]


def test_top_p_below_one_on_the_trained_policy_is_refused_but_allowed_for_another_actor():
    [found] = problems(minimal(env=[{"id": "reverse-text", "sampling": {"top_p": 0.9}}]))
    assert found.startswith("env.0.sampling.top_p = 0.9: the trained policy must sample from its full distribution")
    reference = {"reference": {"name": "tiny", "tokens": True}}
    config = validate_config(minimal(sampling={"top_p": 0.9}, actor="reference", models=reference,
                                     algorithms=["sft"]))
    assert config.sampling.top_p == 0.9


def test_cpu_offload_needs_fsdp_and_runs_on_workers():
    [found] = problems(minimal(trainer={"cpu_offload": True}))
    assert found == ("trainer: trainer.cpu_offload = true needs trainer.parallel = 'fsdp' (FSDP2 "
                     "offloads its shards; DDP keeps a whole copy on every GPU): set trainer.parallel = 'fsdp'")
    config = validate_config(minimal(trainer={"cpu_offload": True, "parallel": "fsdp"}))
    assert config.trainer.num_processes == 1 and config.trainer.uses_workers
    assert not validate_config(minimal(trainer={"parallel": "fsdp"})).trainer.uses_workers


def test_a_micro_batch_shorter_than_the_longest_trace_is_refused_unless_it_truncates():
    out = _cli("train", str(DEMO), "--dry-run", "--set", "trainer.micro_batch_tokens=512")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr == ("error: trainer.micro_batch_tokens = 512 is below "
                          "inference.max_model_len = 1024: a trace as long as the engine serves would fail the train "
                          "stage; raise trainer.micro_batch_tokens to 1024, lower inference.max_model_len to 512, or "
                          "set trainer.truncate = true to cut it\n")
    for fix in ({"micro_batch_tokens": 512, "truncate": True}, {"micro_batch_tokens": 1024}):
        assert validate_config(minimal(trainer=fix)).trainer.micro_batch_tokens == fix["micro_batch_tokens"]
    assert validate_config(minimal(inference={"max_model_len": 512}, trainer={"micro_batch_tokens": 512}))


def test_stop_tokens_must_be_tokens_of_the_model(tiny_model_path):
    [found] = problems(minimal(model={"stop_tokens": ["<|im_end|>", "<|eot_id|>"]}))
    assert found.startswith("model.stop_tokens: '<|eot_id|>' is not a token of tiny's tokenizer")
    [found] = problems(minimal(model={"name": tiny_model_path, "stop_tokens": ["</s>"]}))
    assert f"model.stop_tokens: '</s>' is not a token of {tiny_model_path}'s tokenizer" in found
    config = validate_config(minimal(model={"name": tiny_model_path, "stop_tokens": ["<|im_end|>", "<|endoftext|>"]}))
    assert config.model.stop_tokens == ["<|im_end|>", "<|endoftext|>"]



def test_stop_tokens_of_a_hub_model_are_checked_against_its_cached_tokenizer(realistic_model):
    model = {"name": realistic_model.repo_id, "stop_tokens": ["<|im_end|>", "<|eot|>"]}
    [found] = problems(minimal(model=model))
    assert found.startswith(f"model.stop_tokens: '<|eot|>' is not a token of {realistic_model.repo_id}'s tokenizer")
    model["stop_tokens"] = ["<|im_end|>", "<|endoftext|>"]
    assert validate_config(minimal(model=model)).model.stop_tokens == ["<|im_end|>", "<|endoftext|>"]


def test_schema_env_and_algorithm_problems_are_listed_together():
    """docs/config.md: every wrong key at once; env and algorithm checks run on the entries that parse."""
    found = problems({"name": "run", "stpes": 3, "algorithms": ["nope"], "env": [
        {"id": "no-such-env", "batch_size": 0},  # its batch_size fails the schema; its id is checked all the same
        {"id": "reverse-text", "args": {"min_lenght": 2}, "algorithms": ["grpo", {"id": "echo", "bogus": 1}]},
        {"id": "reverse-text", "group_size": "many"},
    ]})
    assert "stpes: unknown key; did you mean 'steps'?" in found
    assert "env.0.batch_size: Input should be greater than 0 (got 0)" in found
    assert any(p.startswith("env.2.group_size: Input should be a valid integer") for p in found)
    assert any(p.startswith("env.0: unknown env id 'no-such-env'; use a builtin (") for p in found)
    assert any(p.startswith("env.1: env 'reverse-text': args.min_lenght: unknown key") for p in found)
    assert any(p.startswith("algorithms: unknown algorithm 'nope' for env 'no-such-env'") for p in found)
    assert any(p.startswith("env.1.algorithms: algorithm 'echo': ") and "bogus" in p for p in found)
    assert len(found) == 8, found


def test_dry_run_lists_schema_env_and_algorithm_problems_in_one_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(DEMO.read_text().replace("seed = 0", "sead = 0").replace('id = "reverse-text"', 'id = "revers"')
                   .replace('algorithms = ["grpo"]', 'algorithms = ["grop"]'))
    out = _cli("train", str(bad), "--dry-run")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert all(line.startswith("error: ") for line in lines) and len(lines) == 3, lines
    assert "error: sead: unknown key; did you mean 'seed'?" in lines
    assert any(line.startswith("error: env.0: unknown env id 'revers'") for line in lines)
    assert any(line.startswith("error: algorithms: unknown algorithm 'grop' for env 'revers'") for line in lines)


def test_a_bad_subcommand_or_flag_is_one_line_with_where_to_look(capsys):
    from flows.cli import main

    for argv, expected in ((["trian"], "error: argument command: invalid choice: 'trian'"),
                           (["train", "configs/demo.toml", "--dry-rum"], "error: unrecognized arguments: --dry-rum")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(expected) and line.endswith("--help`"), line


def test_an_import_path_whose_module_is_nowhere_says_so_with_the_fix():
    [found] = problems(minimal(algorithms=["nosuchpkg.algos:LengthPenalty"]))
    assert found == ("algorithms: algorithm 'nosuchpkg.algos:LengthPenalty': module 'nosuchpkg.algos' was not found "
                     "on sys.path; run trace-rl from the directory that holds nosuchpkg/ (or nosuchpkg.py), add that "
                     "directory to PYTHONPATH, or pip install the package; or set env.server to run it on an env "
                     "server")
    [found] = problems(minimal(env=[{"id": "nosuchpkg.envs:MyEnv"}]))
    assert found.startswith("env.0: env 'nosuchpkg.envs:MyEnv': module 'nosuchpkg.envs' was not found on sys.path; ")


DOC_ALGORITHM_CONFIG = 'algorithms = ["grpo", {id = "mypkg.algos:LengthPenalty", per_token = 0.002}]'


def test_the_docs_own_algorithm_loads_from_the_working_directory(tmp_path):
    """docs/algorithms.md's `mypkg/algos.py`, as written there, next to where `trace-rl` runs: found without
    PYTHONPATH. `python -P` does not put the working directory on sys.path, as the installed `trace-rl` script
    does not: the CLI itself adds it."""
    import re

    doc = (ROOT / "docs" / "algorithms.md").read_text()
    code = re.search(r"```python\n# mypkg/algos.py\n(.*?)```", doc, re.S).group(1)
    assert DOC_ALGORITHM_CONFIG in doc
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "algos.py").write_text(code)
    (tmp_path / "run.toml").write_text(DEMO.read_text().replace('algorithms = ["grpo"]', DOC_ALGORITHM_CONFIG))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def dry_run(cwd):
        return subprocess.run([sys.executable, "-P", "-m", "flows.cli", "train", str(tmp_path / "run.toml"),
                               "--dry-run"], capture_output=True, text=True, cwd=cwd, env=env, check=False)

    out = dry_run(tmp_path)
    assert out.returncode == 0, out.stderr
    assert 'id = "mypkg.algos:LengthPenalty"' in out.stdout
    out = dry_run(tmp_path.parent)  # elsewhere: the module is nowhere, and the error says so
    assert out.returncode == 2 and "module 'mypkg.algos' was not found on sys.path; run trace-rl from the " \
                                   "directory that holds mypkg/" in out.stderr, out.stderr


def test_dry_run_refuses_colocate_with_a_cpu_trainer():
    """docs/inference.md: `colocate = true` with the trainer on CPU is refused; `device = 'auto'` on a machine
    without a GPU (CUDA_VISIBLE_DEVICES='' hides any) is a CPU trainer."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(DEMO), "--dry-run", "--set",
                          "inference.colocate=true"], capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr == ("error: inference.colocate = true: trainer.device = 'auto' trains on "
                          "the CPU here (this machine has no GPU), which shares no GPU with the engines; remove "
                          "inference.colocate (by default the engines colocate whenever the trainer is on CUDA)\n")


def test_help_says_what_trace_rl_is_in_whole_sentences(capsys):
    from flows.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "RL post-training on token-exact traces, every training step a Prefect flow run: train, evaluate, " \
           "replay and export runs, and serve them as deployments (README.md, docs/)." in text
    assert "serve the train, eval and replay flows as deployments" in text
