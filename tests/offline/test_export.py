"""`trace-rl export RUN --step N --merged DIR | --adapter DIR` on real trainer runs of the tiny model."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from flows.cli import main
from tests.inference.conftest import model_logprobs, peft_logprobs, trainer_logprobs
from tests.trainer.conftest import make_batch
from trace_rl.config import Config, config_to_toml
from trace_rl.storage import RunStorage, record_run_version
from trace_rl.tables import write_batch
from trace_rl.trainer.lifecycle import train_one_step
from trace_rl.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TOKENS = [1, 60, 61, 62, 63, 70, 71, 72, 80, 81]


def trained_run(root, name: str, model: dict, steps: int = 2) -> RunStorage:
    config = Config(name=name, storage=str(root), env=[{"id": "reverse-text"}], model=model,
                    inference={"max_model_len": 256}, trainer={"lr": 2e-2, "micro_batch_tokens": 256, "device": "cpu"})
    storage = RunStorage(config.storage, config.name)
    storage.write_atomic(storage.path("config.toml"), config_to_toml(config).encode())
    record_run_version(storage)
    trainer = Trainer(config, storage)
    for step in range(1, steps + 1):
        write_batch(storage, step, make_batch(step))
        train_one_step(config, storage, step, trainer)
    return storage


@pytest.fixture(scope="module")
def lora_run(tiny_model_path, tmp_path_factory) -> RunStorage:
    return trained_run(tmp_path_factory.mktemp("export"), "lora", {"name": tiny_model_path, "lora": {"rank": 4}})


def test_merged_weights_load_in_transformers_with_the_logprobs_of_base_plus_adapter(lora_run, tiny_model_path,
                                                                                    tmp_path):
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert main(["export", lora_run.url, "--step", "2", "--merged", str(merged), "--adapter", str(adapter)]) == 0
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    # a plain transformers model: no adapter layers, the base model's tensor names and shapes
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert model.state_dict().keys() == base.state_dict().keys()
    assert (merged / "tokenizer_config.json").is_file()
    expected = peft_logprobs(tiny_model_path, str(adapter), TOKENS, 0.7)
    np.testing.assert_allclose(model_logprobs(model, TOKENS, 0.7), expected, atol=1e-5)
    assert np.abs(expected - trainer_logprobs(tiny_model_path, TOKENS, 0.7)).max() > 1e-2  # the adapter matters
    # the adapter written is step 2's
    step2 = lora_run.path("weights", "000002")
    np.testing.assert_allclose(peft_logprobs(tiny_model_path, step2, TOKENS, 0.7), expected, atol=0)


@pytest.mark.vllm
def test_merged_weights_load_in_vllm(lora_run, tiny_model_path, tmp_path, shared_vllm):
    merged = tmp_path / "merged"
    assert main(["export", lora_run.url, "--step", "1", "--merged", str(merged)]) == 0
    asyncio.run(shared_vllm.load_weights(str(merged), 1))
    np.testing.assert_allclose(
        asyncio.run(shared_vllm.score(TOKENS)),
        peft_logprobs(tiny_model_path, lora_run.path("weights", "000001"), TOKENS, 1.0), atol=2e-4)


def test_bad_exports_are_refused_with_the_fix(lora_run, tiny_model_path, tmp_path, capsys):
    full = trained_run(tmp_path, "full", {"name": tiny_model_path}, steps=1)
    cases = [
        (["export", full.url, "--step", "1", "--adapter", str(tmp_path / "a")], "holds full weights .* --merged"),
        (["export", lora_run.url, "--step", "7", "--merged", str(tmp_path / "m")],
         r"--step 7: .* has no complete weights of step 7 \(not trained yet\); steps with weights: 1, 2; pass one "
         r"of them, e.g. --step 2$"),
        (["export", lora_run.url, "--step", "1"], "pass --merged DIR"),
        (["export", str(tmp_path / "nothing"), "--step", "1", "--merged", str(tmp_path / "m")], "RUN .*no config.toml"),
        (["export", lora_run.url, "--step", "1", "--merged", str(tmp_path)], "exists and is not an empty directory"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        assert re.search(message, capsys.readouterr().err), argv
    assert not (tmp_path / "a").exists() and not (tmp_path / "m").exists()
    # a full-weight run's --merged is its weights as they are
    assert main(["export", full.url, "--step", "1", "--merged", str(tmp_path / "copy")]) == 0
    np.testing.assert_array_equal(trainer_logprobs(str(tmp_path / "copy"), TOKENS, 1.0),
                                  trainer_logprobs(full.path("weights", "000001"), TOKENS, 1.0))


def test_replay_from_a_lora_runs_step_is_refused_with_the_export_to_use(lora_run, tmp_path, capsys):
    assert main(["replay", "--run", lora_run.url, "--algorithms", '["grpo"]', "--out", str(tmp_path / "out"),
                 "--train", "--from-step", "1"]) == 2
    err = capsys.readouterr().err
    assert "--from-step 1: the run trains LoRA adapters" in err and "--merged DIR) and pass --model DIR" in err


def test_a_pruned_step_is_refused_naming_the_steps_with_weights(tmp_path, capsys):
    """README's export of configs/lora.toml: 60 steps, of which `[ckpt]` may have pruned all but the last weights."""
    from trace_rl.runs.loading import load_config

    config = load_config(ROOT / "configs" / "lora.toml", [f"storage={json.dumps(str(tmp_path))}"])
    storage = RunStorage(config.storage, config.name)
    storage.write_atomic(storage.path("config.toml"), config_to_toml(config).encode())
    record_run_version(storage)
    for step in (59, 60):
        storage.mark_stable(storage.path("weights", f"{step:06d}"))
    assert main(["export", storage.url, "--step", "30", "--merged", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --step 30: {storage.url} has no complete weights of step 30 (pruned after training: "
                   "[ckpt] keeps only some steps' weights, docs/trainer.md); steps with weights: 59, 60; pass one "
                   "of them, e.g. --step 60\n")
    assert not (tmp_path / "merged").exists()
    for doc in ("README.md", "docs/lora.md"):  # the docs export the last step, which every run keeps
        commands = re.findall(r"trace-rl export runs/lora --step (\d+)", (ROOT / doc).read_text())
        assert commands and set(commands) == {str(config.steps)}, doc
