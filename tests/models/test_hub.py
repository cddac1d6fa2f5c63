"""Model names resolve through the Hugging Face cache (trace_rl.models.hub), checked on the realistic fixture model
(trace_rl.models.realistic): found by hub id offline, pinned by commit, and a clear error for what is not cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.models.realistic import VOCAB_SIZE
from trace_rl.config import ConfigError
from trace_rl.models.hub import ModelNotFoundError, resolve_model_path
from trace_rl.pipeline.colocation import runtime_configs
from trace_rl.runs.loading import load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"
MISSING = "nobody-here/missing-model"


def offline_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}


def test_fixture_resolves_by_hub_id_offline_as_huggingface_hub_finds_it(realistic_model):
    assert resolve_model_path(realistic_model.repo_id) == realistic_model.path
    assert resolve_model_path(realistic_model.repo_id, "main") == realistic_model.path
    # a fresh process that only has the environment finds it with huggingface_hub's own functions
    probe = ("import sys; from huggingface_hub import snapshot_download, try_to_load_from_cache; "
             "print(snapshot_download(sys.argv[1], local_files_only=True)); "
             "print(try_to_load_from_cache(sys.argv[1], 'model.safetensors'))")
    out = subprocess.run([sys.executable, "-c", probe, realistic_model.repo_id], capture_output=True, text=True,
                         env=offline_env(realistic_model.cache), check=True)
    snapshot, weights = out.stdout.split()
    assert snapshot == realistic_model.path and weights == f"{realistic_model.path}/model.safetensors"
    assert (realistic_model.cache / "models--trace-rl--qwen2-fixture" / "refs" / "main").read_text() == \
        realistic_model.commit


def test_revision_as_commit_hash_resolves_and_an_unknown_revision_is_a_clear_error(realistic_model):
    assert len(realistic_model.commit) == 40
    assert resolve_model_path(realistic_model.repo_id, realistic_model.commit) == realistic_model.path
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path(realistic_model.repo_id, "v9-never-made")
    message = str(caught.value)
    assert "'trace-rl/qwen2-fixture' at revision 'v9-never-made' is not in the Hugging Face cache" in message
    assert "huggingface-cli download trace-rl/qwen2-fixture --revision v9-never-made" in message
    assert "hf download trace-rl/qwen2-fixture --revision v9-never-made" in message


def test_local_directories_and_tiny_resolve_to_themselves(tiny_model_path, realistic_model):
    assert resolve_model_path(tiny_model_path) == tiny_model_path
    assert resolve_model_path("tiny") == tiny_model_path
    assert resolve_model_path(realistic_model.path, "ignored-for-directories") == realistic_model.path


def test_runtime_configs_carry_the_revision_to_every_consumer(realistic_model):
    config = load_config(DEMO, [f"model.name={realistic_model.repo_id}", f"model.revision={realistic_model.commit}",
                                f"models.reference.name={realistic_model.repo_id}"])
    configs = runtime_configs(config)
    assert configs["policy"].revision == realistic_model.commit and configs["reference"].revision is None
    assert resolve_model_path(configs["policy"].name, configs["policy"].revision) == realistic_model.path


def test_config_check_names_the_key_of_a_model_missing_offline(realistic_model, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: the fixture is not there either
    with pytest.raises(ConfigError) as caught:
        load_config(DEMO, [f"model.name={MISSING}", "models.reference.name=nobody-here/other",
                           "models.reference.tokens=true", "models.judge.name=some-api/model"])
    problems = caught.value.problems
    assert len(problems) == 2  # the judge (tokens = false) is never loaded, so it is not checked
    assert problems[0].startswith(f"model.name: '{MISSING}' at revision 'main' is not in the Hugging Face cache")
    assert problems[1].startswith("models.reference.name: 'nobody-here/other'")


def test_online_a_missing_id_is_no_config_error_and_a_malformed_name_always_is(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert load_config(DEMO, [f"model.name={MISSING}"]).model.name == MISSING  # downloaded when the run starts
    with pytest.raises(ConfigError, match=r"model.name: '/no/such/dir' is neither 'tiny', an existing local "
                                          r"directory, a .gguf file, nor a Hugging Face id"):
        load_config(DEMO, ["model.name=/no/such/dir"])


def test_dry_run_of_a_missing_hub_id_offline_exits_2_with_one_clear_message(tmp_path):
    config = tmp_path / "missing.toml"
    config.write_text(DEMO.read_text().replace('name = "tiny"', f'name = "{MISSING}"\nrevision = "v2"'))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(config), "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT, env=offline_env(tmp_path / "empty-cache"))
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.count("error: ") == 1
    assert f"model.name: '{MISSING}' at revision 'v2' is not in the Hugging Face cache" in out.stderr
    assert f"huggingface-cli download {MISSING} --revision v2" in out.stderr


def test_dry_run_of_the_cached_fixture_offline_passes_without_torch_or_vllm(realistic_model, tmp_path):
    config = tmp_path / "fixture.toml"
    config.write_text(DEMO.read_text().replace('name = "tiny"', f'name = "{realistic_model.repo_id}"'))
    probe = ("import sys, flows.cli as c; rc = c.main(sys.argv[1:]); "
             "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'dry run imported torch/vllm'; "
             "sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", probe, "train", str(config), "--dry-run"], capture_output=True,
                         text=True, cwd=ROOT, env=offline_env(realistic_model.cache))
    assert out.returncode == 0, out.stderr
    assert realistic_model.repo_id in out.stdout


def test_fixture_loads_with_a_qwen_sized_embedding_and_a_small_tokenizer(realistic_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(realistic_model.repo_id)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.get_input_embeddings().weight.shape == (VOCAB_SIZE, 64) == (151936, 64)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # tied
    assert 1000 < len(tokenizer) < VOCAB_SIZE
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    with torch.no_grad():  # ids past the tokenizer (padding rows) are never likely
        probs = model(torch.tensor([tokenizer.encode("Hello there, what is the time?")])).logits.softmax(-1)
    assert probs[..., len(tokenizer):].sum(-1).max() < 1e-3


def test_fixture_chat_template_renders_hermes_tool_calls(realistic_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(realistic_model.path)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        {"role": "user", "content": "what is a?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}}]},
        {"role": "tool", "content": "42"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    kept = tokenizer.decode(ids, skip_special_tokens=True)  # tool-call markup is not special, as in Qwen3
    assert "<tool_call>" in kept and "<|im_start|>" not in kept


def test_fixture_generation_config_has_non_neutral_defaults(realistic_model):
    from transformers import AutoTokenizer

    generation = json.loads((Path(realistic_model.path) / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(realistic_model.path)
    assert {k: generation[k] for k in ("top_k", "top_p", "temperature", "repetition_penalty", "do_sample")} == \
        {"top_k": 20, "top_p": 0.8, "temperature": 0.7, "repetition_penalty": 1.05, "do_sample": True}
    assert generation["eos_token_id"][0] == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    config = json.loads((Path(realistic_model.path) / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"]
