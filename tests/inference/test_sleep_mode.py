"""vLLM sleep mode around a colocated trainer: sleep frees the GPU, wake-up gives the same engine back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from trace_rl.models.runtime import RuntimeConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="vLLM's sleep mode needs a CUDA GPU (its CPU backend has none)")


def test_sleep_frees_gpu_memory_and_wake_up_samples_the_same_tokens(tiny_model_path):
    from trace_rl.inference.vllm_engine import VLLMEngineRuntime

    runtime = VLLMEngineRuntime(RuntimeConfig(key="sleepy", name=tiny_model_path, backend="vllm", sleep_mode=True,
                                              gpu_memory_utilization=0.3))

    def sample():
        return asyncio.run(runtime.generate([5, 6, 7], temperature=1.0, max_tokens=16, seed=3)).token_ids

    before = sample()
    free_awake, total = torch.cuda.mem_get_info()
    asyncio.run(runtime.sleep())
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_awake > 0.2 * total  # the KV cache of a 0.3 share is gone
    asyncio.run(runtime.wake_up())
    asyncio.run(runtime.load_weights(tiny_model_path, 0))
    assert sample() == before
    runtime.worker.stop()
