"""The samplers on the realistic fixture (Qwen2 architecture, 151,936-row vocabulary, a generation_config.json
with top_k = 20, top_p = 0.8, repetition_penalty = 1.05): they sample the distribution the trainer computes,
whatever that file says."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from tests.conftest import VLLM_ENGINE
from tests.inference.conftest import trainer_logprobs
from trace_rl.inference.build import build_runtime
from trace_rl.models.runtime import RuntimeConfig, load_tokenizer

TOLERANCE = 2e-4
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def prompt(realistic_model) -> list[int]:
    """A chat prompt of more than one 128-token KV block, rendered by the fixture's Qwen-style template."""
    tokenizer = load_tokenizer(realistic_model.path)
    text = " ".join(["the quick brown fox jumps over the lazy dog and then it rests"] * 20)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) > 128
    return ids


@pytest.fixture(scope="module")
def without_generation_config(realistic_model, tmp_path_factory) -> str:
    copy = tmp_path_factory.mktemp("no-generation-config") / "model"
    shutil.copytree(realistic_model.path, copy)
    (copy / "generation_config.json").unlink()
    return str(copy)


def sample(runtime, prompt, seed=4):
    return asyncio.run(runtime.generate(prompt, temperature=TEMPERATURE, max_tokens=24, top_p=1.0, seed=seed))


def test_generation_config_defaults_change_nothing_in_the_hf_sampler(realistic_model, without_generation_config,
                                                                      prompt):
    with_file, without_file = (build_runtime(RuntimeConfig(key="policy", name=path, backend="hf"))
                               for path in (realistic_model.path, without_generation_config))
    first, second = sample(with_file, prompt), sample(without_file, prompt)
    assert first.token_ids == second.token_ids and first.logprobs == second.logprobs
    expected = trainer_logprobs(realistic_model.path, prompt + first.token_ids, TEMPERATURE)[len(prompt):]
    np.testing.assert_allclose(first.logprobs, expected, atol=TOLERANCE)


@pytest.mark.vllm
def test_vllm_samples_the_trainers_distribution_despite_generation_config(realistic_model, prompt):
    """top_k = 20 would renormalize over 20 tokens (logprobs near -3 instead of near -log(vocab)), and the
    repetition penalty would move repeated tokens: the logprobs equal the trainer's full softmax at T instead."""
    runtime = build_runtime(RuntimeConfig(key="policy", name=realistic_model.repo_id, backend="vllm",
                                          revision=realistic_model.commit, **VLLM_ENGINE))
    assert runtime.worker.model_path == realistic_model.path
    generations = [sample(runtime, prompt, seed) for seed in range(3)]
    for generation in generations:
        expected = trainer_logprobs(realistic_model.path, prompt + generation.token_ids, TEMPERATURE)[len(prompt):]
        np.testing.assert_allclose(generation.logprobs, expected, atol=TOLERANCE)
    tokenizer = load_tokenizer(realistic_model.path)
    assert all(t < len(tokenizer) for g in generations for t in g.token_ids)  # unused embedding rows never win
    with pytest.raises(ValueError, match=r"151936-token vocabulary.*temperature = 1.0"):
        asyncio.run(runtime.score(prompt, temperature=TEMPERATURE))
    np.testing.assert_allclose(asyncio.run(runtime.score(prompt)), trainer_logprobs(realistic_model.path, prompt, 1.0),
                               atol=TOLERANCE)
