"""Fixtures for sampler tests: a run whose `weights/000001/` is a changed tiny model, and the
trainer's logprobs of a token sequence (the reference the samplers must match)."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from trace_rl.data.sample import TrainingSample
from trace_rl.models.runtime import load_tokenizer
from trace_rl.storage import RunStorage
from trace_rl.trainer.packing import collate
from trace_rl.trainer.trainer import token_logprobs

UPDATED_STEP = 1


def trainer_logprobs(model_dir: str, token_ids: list[int], temperature: float) -> np.ndarray:
    """What the trainer computes for `token_ids` (one sample) with the weights in `model_dir`."""
    return model_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), token_ids,
                          temperature)


def peft_logprobs(base_dir: str, adapter_dir: str, token_ids: list[int], temperature: float) -> np.ndarray:
    """The trainer's logprobs of `token_ids` with transformers + peft: the base model with the adapter applied."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    # peft puts the adapter's layers into the transformers model in place: call that model, as the trainer does
    return model_logprobs(PeftModel.from_pretrained(base, adapter_dir).get_base_model().eval(), token_ids, temperature)


def model_logprobs(model: torch.nn.Module, token_ids: list[int], temperature: float) -> np.ndarray:
    n = len(token_ids)
    zeros = np.zeros(n, dtype=np.float32)
    sample = TrainingSample(
        trace_id="t", branch_index=0, env="e", input_ids=np.asarray(token_ids, dtype=np.int32),
        temperature=temperature, sampled=np.ones(n, bool), inference_logprobs=zeros, rl_values=zeros,
        rl_mask=zeros.astype(bool), ce_values=zeros, ce_mask=zeros.astype(bool),
    )
    with torch.no_grad():
        lp, _ = token_logprobs(model, collate([sample]), torch.device("cpu"))
    return lp.numpy()


def save_updated_model(base_dir: str, target_dir: str, seed: int = 1, scale: float = 0.05) -> None:
    """The base model with every weight moved by seeded noise: a stand-in for a trainer update."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(target_dir, safe_serialization=True)
    load_tokenizer(base_dir).save_pretrained(target_dir)


@pytest.fixture(scope="session")
def updated_weights(tiny_model_path, tmp_path_factory) -> RunStorage:
    """A local run with `weights/000001/` (STABLE) holding changed tiny-model weights."""
    storage = RunStorage(str(tmp_path_factory.mktemp("runs")), "broadcast")
    with tempfile.TemporaryDirectory() as staging:
        save_updated_model(tiny_model_path, staging)
        storage.upload_dir(staging, storage.path("weights", f"{UPDATED_STEP:06d}"))
    return storage


@pytest.fixture(scope="session")
def prompt_ids(tiny_model_path) -> list[int]:
    tokenizer = load_tokenizer(tiny_model_path)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "reverse: hello"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


@pytest.fixture(scope="session")
def hf_runtime(tiny_model_path):
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig

    return build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf"))


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def runtime(request):
    """Each in-process sampler in turn (the vLLM one is the session's shared engine)."""
    return request.getfixturevalue("hf_runtime" if request.param == "hf" else "vllm_runtime")


LORA_STEPS = 3
ADAPTER_RANK = 8  # below the session LoRA engine's LORA_RANK: an engine serves any adapter up to its rank


@pytest.fixture(scope="session")
def lora_run(tiny_model_path, tmp_path_factory) -> RunStorage:
    """A LoRA run of the tiny model (rank ADAPTER_RANK, all projections) with adapters `weights/000001..3/` from real
    trainer steps on synthetic batches."""
    from tests.trainer.conftest import make_batch
    from trace_rl.config import Config
    from trace_rl.tables import write_batch
    from trace_rl.trainer.lifecycle import train_one_step
    from trace_rl.trainer.trainer import Trainer

    config = Config(name="lora", storage=str(tmp_path_factory.mktemp("lora-runs")), env=[{"id": "synthetic"}],
                    model={"name": tiny_model_path, "lora": {"rank": ADAPTER_RANK}},
                    inference={"max_model_len": 256}, trainer={"lr": 2e-2, "micro_batch_tokens": 256, "device": "cpu"},
                    ckpt={"keep": LORA_STEPS})  # every step's adapter stays: the tests load each of them
    storage = RunStorage(config.storage, config.name)
    trainer = Trainer(config, storage)
    for step in range(1, LORA_STEPS + 1):
        write_batch(storage, step, make_batch(step))
        train_one_step(config, storage, step, trainer)
    return storage
