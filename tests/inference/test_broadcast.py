"""Weight broadcast into the in-process samplers: new weights become visible (logprobs change and
match the trainer's for the new weights), failures leave the old weights, object storage is staged."""

from __future__ import annotations

import asyncio
import tempfile

import numpy as np
import pytest
from safetensors.torch import save_file
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import VLLM_ENGINE
from tests.inference.conftest import UPDATED_STEP, model_logprobs, save_updated_model, trainer_logprobs
from trace_rl.inference.broadcast import BroadcastError, broadcast_weights
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.storage import RunStorage

TOLERANCE = 2e-4
BFLOAT16_TOLERANCE = 5e-2  # a bfloat16 engine against the bfloat16 trainer: 2e-3 before a reload, 1.1e-2 after


@pytest.fixture
def restore(runtime, tiny_model_path):
    """Put the runtime back on the tiny model's own weights (the vLLM engine is shared by the session)."""
    yield runtime
    asyncio.run(runtime.load_weights(tiny_model_path, 0))
    runtime.policy_step = 0


def test_broadcast_makes_new_weights_visible(restore, updated_weights, prompt_ids, tiny_model_path):
    runtime = restore
    tokens = prompt_ids + [70, 71, 72, 73]
    before = asyncio.run(runtime.score(tokens))
    asyncio.run(broadcast_weights(runtime, updated_weights, UPDATED_STEP))
    assert runtime.policy_step == UPDATED_STEP
    after = asyncio.run(runtime.score(tokens))
    new_dir = updated_weights.path("weights", f"{UPDATED_STEP:06d}")
    assert np.abs(after - before).max() > 1e-2
    np.testing.assert_allclose(after, trainer_logprobs(new_dir, tokens, 1.0), atol=TOLERANCE)
    generation = asyncio.run(runtime.generate(prompt_ids, temperature=0.8, max_tokens=12, top_p=1.0, seed=1))
    expected = trainer_logprobs(new_dir, prompt_ids + generation.token_ids, 0.8)[len(prompt_ids):]
    np.testing.assert_allclose(generation.logprobs, expected, atol=TOLERANCE)


def write_wrong_shapes(storage: RunStorage, step: int, base_dir: str) -> None:
    """A STABLE weights directory whose embedding has the wrong shape."""
    with tempfile.TemporaryDirectory() as staging:
        save_updated_model(base_dir, staging)
        save_file({"model.embed_tokens.weight": torch.zeros(3, 128)}, f"{staging}/model.safetensors")
        storage.upload_dir(staging, storage.path("weights", f"{step:06d}"))


def test_failed_broadcast_keeps_old_weights_and_names_step_and_backend(restore, tmp_path, prompt_ids, tiny_model_path):
    runtime = restore
    storage = RunStorage(str(tmp_path), "failing")
    storage.fs.makedirs(storage.path("weights", "000003"))  # exists but never marked STABLE
    write_wrong_shapes(storage, 4, tiny_model_path)
    tokens = prompt_ids + [70, 71]
    before = asyncio.run(runtime.score(tokens))
    backend = "vllm in-process engine" if runtime.config.backend == "vllm" else "hf in-process model"
    for step, reason in [(2, "not STABLE"), (3, "not STABLE"), (4, "shape mismatch")]:
        with pytest.raises(BroadcastError) as failure:
            asyncio.run(broadcast_weights(runtime, storage, step))
        message = str(failure.value)
        assert f"step {step}" in message and backend in message and reason in message
        assert runtime.policy_step == 0
        np.testing.assert_array_equal(asyncio.run(runtime.score(tokens)), before)


def test_broadcast_stages_object_storage_weights_locally(hf_runtime, s3_server, updated_weights, prompt_ids,
                                                         tiny_model_path):
    storage = RunStorage(f"s3://{s3_server['bucket']}", "staged", s3_server["storage_options"])
    local = updated_weights.path("weights", f"{UPDATED_STEP:06d}")
    storage.upload_dir(local, storage.path("weights", "000005"))
    tokens = prompt_ids + [80, 81]
    try:
        asyncio.run(broadcast_weights(hf_runtime, storage, 5))
        assert hf_runtime.policy_step == 5
        np.testing.assert_allclose(asyncio.run(hf_runtime.score(tokens)), trainer_logprobs(local, tokens, 1.0),
                                   atol=TOLERANCE)
    finally:
        asyncio.run(hf_runtime.load_weights(tiny_model_path, 0))
        hf_runtime.policy_step = 0


@pytest.mark.vllm
def test_reload_never_serves_prefix_cached_kv_of_the_old_weights(vllm_runtime, tiny_model_path, updated_weights):
    """Prompts of 300 tokens share a 280-token prefix (two full 128-token KV blocks, cached by the first
    request); after a reload the sampled logprobs must be the new weights', not the cached old KV's."""
    runtime = vllm_runtime
    prefix = [(5 * i) % 250 + 5 for i in range(280)]
    first, second = prefix + list(range(10, 30)), prefix + list(range(40, 60))
    sample = lambda prompt: asyncio.run(  # noqa: E731
        runtime.generate(prompt, temperature=0.8, max_tokens=8, top_p=1.0, seed=2))
    try:
        sample(first)  # caches the prefix's KV blocks under the old weights
        asyncio.run(broadcast_weights(runtime, updated_weights, UPDATED_STEP))
        generation = sample(second)
    finally:
        asyncio.run(runtime.load_weights(tiny_model_path, 0))
        runtime.policy_step = 0
    new_dir = updated_weights.path("weights", f"{UPDATED_STEP:06d}")
    expected = trainer_logprobs(new_dir, second + generation.token_ids, 0.8)[len(second):]
    np.testing.assert_allclose(generation.logprobs, expected, atol=TOLERANCE)


@pytest.mark.vllm
def test_a_bfloat16_engine_computes_float32_logits_with_the_output_layer_it_reloads(tiny_model_path, updated_weights,
                                                                                    prompt_ids):
    """A bfloat16 engine on CPU projects onto the vocabulary with a float32 copy of its output layer, made at start
    and after each reload (trace_rl/inference/vllm_worker.py): its logprobs follow the trainer's in bfloat16 before
    and after a broadcast, never the previous weights' output layer."""
    from trace_rl.inference.vllm_engine import VLLMEngineRuntime

    def trainer_bf16(model_dir: str, tokens: list[int]) -> np.ndarray:
        return model_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval(), tokens,
                              1.0)

    runtime = VLLMEngineRuntime(RuntimeConfig(key="bfloat16", name=tiny_model_path, backend="vllm", dtype="bfloat16",
                                              **VLLM_ENGINE))
    try:
        tokens = prompt_ids + [70, 71, 72, 73]
        before = asyncio.run(runtime.score(tokens))
        asyncio.run(broadcast_weights(runtime, updated_weights, UPDATED_STEP))
        after = asyncio.run(runtime.score(tokens))
    finally:
        runtime.worker.stop()
    new_dir = updated_weights.path("weights", f"{UPDATED_STEP:06d}")
    old, new = trainer_bf16(tiny_model_path, tokens), trainer_bf16(new_dir, tokens)
    assert np.abs(new - old).max() > 1.0
    np.testing.assert_allclose(before, old, atol=BFLOAT16_TOLERANCE)
    np.testing.assert_allclose(after, new, atol=BFLOAT16_TOLERANCE)  # a stale copy was 1.46 off
