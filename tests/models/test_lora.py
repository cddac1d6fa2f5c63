"""`[model.lora]` config checks: each bad setting is a clear error at config load / `--dry-run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.config import DEFAULT_LORA_TARGETS, ConfigError
from trace_rl.models.lora import block_linear_names, vllm_max_lora_rank
from trace_rl.runs.loading import load_config, validate_config

ROOT = Path(__file__).resolve().parents[2]


def data(lora, **extra):
    return {"name": "run", "env": [{"id": "reverse-text"}], "model": {"name": "tiny", "lora": lora}, **extra}


def problems(value) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(value)
    return info.value.problems


def test_defaults_are_the_attention_and_mlp_projections():
    lora = validate_config(data({"rank": 8})).model.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (8, 16.0, 0.0)
    assert lora.target_modules == DEFAULT_LORA_TARGETS
    assert validate_config(data(None)).model.lora is None


@pytest.mark.parametrize("rank", [0, -4])
def test_rank_must_be_positive(rank):
    assert problems(data({"rank": rank})) == [f"model.lora.rank: Input should be greater than 0 (got {rank})"]


def test_rank_vllm_cannot_serve_is_refused_for_the_vllm_backend():
    assert problems(data({"rank": 1024}, inference={"backend": "vllm"})) == [
        "model.lora.rank = 1024: vLLM serves adapters up to rank 512; lower it"]
    assert validate_config(data({"rank": 1024}, inference={"backend": "hf"})).model.lora.rank == 1024
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


def test_unknown_target_module_names_the_models_linears(tiny_model_path):
    [found] = problems(data({"rank": 4, "target_modules": ["q_proj", "qkv_proj"]}))
    assert found == ("model.lora.target_modules: 'qkv_proj' is not a Linear of tiny's decoder blocks; use some of: "
                     "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj")
    # a local model directory: its Linears are read from the safetensors headers
    model = {"name": tiny_model_path, "lora": {"rank": 4, "target_modules": ["c_attn", "embed_tokens"]}}
    [found] = problems({"name": "run", "env": [{"id": "reverse-text"}], "model": model})
    assert found.startswith("model.lora.target_modules: 'c_attn', 'embed_tokens' are not Linears of ")
    assert block_linear_names(tiny_model_path) == set(DEFAULT_LORA_TARGETS)


def test_a_hub_models_targets_come_from_its_cached_files(realistic_model):
    model = {"name": realistic_model.repo_id, "lora": {"rank": 4, "target_modules": ["q_proj", "W_pack"]}}
    [found] = problems({"name": "run", "env": [{"id": "reverse-text"}], "model": model})
    assert found.startswith(f"model.lora.target_modules: 'W_pack' is not a Linear of {realistic_model.repo_id}'s")


def test_fsdp_and_adapters_on_other_models_are_refused():
    trainer = {"num_processes": 2, "parallel": "fsdp"}
    [found] = problems(data({"rank": 4}, trainer=trainer))
    assert found.startswith("model.lora with trainer.parallel = 'fsdp' is not supported; use trainer.parallel = 'ddp'")
    [found] = problems(data({"rank": 4}, trainer={**trainer, "num_processes": 1}))  # docs/config.md: any fsdp
    assert found.startswith("model.lora with trainer.parallel = 'fsdp' is not supported")
    assert validate_config(data({"rank": 4}, trainer={"num_processes": 2})).model.lora.rank == 4  # ddp
    [found] = problems(data({"rank": 4}, trainer={**trainer, "num_processes": 1, "cpu_offload": True}))
    assert found.startswith("model.lora with trainer.parallel = 'fsdp' is not supported")
    [found] = problems(data(None, models={"reference": {"name": "tiny", "lora": {"rank": 4}}}))
    assert found == "models.reference.lora: only the trained model has adapters; move it to [model.lora] or remove it"


def test_dry_run_refuses_lora_with_fsdp_on_one_process():
    out = subprocess.run([sys.executable, "-m", "flows.cli", "train", "configs/lora.toml", "--dry-run",
                          "--set", "trainer.parallel=fsdp"], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr == ("error: model.lora with trainer.parallel = 'fsdp' is not supported; use "
                          "trainer.parallel = 'ddp' (the default; adapters are small: every rank holds them whole), "
                          "without trainer.cpu_offload\n")


def test_dry_run_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "configs" / "lora.toml").read_text().replace("rank = 16", "rank = 0"))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(bad), "--dry-run"], capture_output=True,
                         text=True, cwd=ROOT, check=False)
    assert out.returncode == 2 and "model.lora.rank: Input should be greater than 0 (got 0)" in out.stderr
    assert load_config(ROOT / "configs" / "lora.toml").model.lora.rank == 16
