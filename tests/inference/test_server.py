"""The vLLM server sampler against a real `vllm.entrypoints.openai.api_server` on 127.0.0.1."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.inference.conftest import UPDATED_STEP, trainer_logprobs
from tests.inference.test_samplers import assert_stop_strings_cut_turns
from trace_rl.inference.broadcast import BroadcastError, broadcast_weights
from trace_rl.inference.build import build_runtime
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.storage import RunStorage

pytestmark = pytest.mark.vllm
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def server_runtime(vllm_server, tiny_model_path):
    # the same server twice: round-robin over two endpoints
    return build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="vllm",
                                       base_urls=[vllm_server.url, f"{vllm_server.url}/v1"]))


def test_server_generates_reproducibly_with_trainer_logprobs(server_runtime, prompt_ids, tiny_model_path):
    assert server_runtime.num_endpoints == 2

    async def main():
        sample = lambda: server_runtime.generate(prompt_ids, temperature=0.9, max_tokens=10, top_p=1.0, seed=11)  # noqa: E731
        return await asyncio.gather(sample(), sample())

    first, again = asyncio.run(main())
    assert first.token_ids == again.token_ids and len(first.token_ids) == 10
    expected = trainer_logprobs(tiny_model_path, prompt_ids + first.token_ids, 0.9)[len(prompt_ids):]
    np.testing.assert_allclose(first.logprobs, expected, atol=TOLERANCE)
    tokens = prompt_ids + first.token_ids
    for endpoint in range(2):
        scores = asyncio.run(server_runtime.score(tokens, temperature=0.9, endpoint=endpoint))
        np.testing.assert_allclose(scores, trainer_logprobs(tiny_model_path, tokens, 0.9), atol=TOLERANCE)


def test_server_stop_strings_cut_turns_as_the_engine_does(server_runtime, prompt_ids):
    assert_stop_strings_cut_turns(server_runtime, prompt_ids)


def test_server_broadcast_pauses_reloads_and_resumes(server_runtime, updated_weights, tmp_path, prompt_ids,
                                                     tiny_model_path):
    tokens = prompt_ids + [70, 71, 72]
    before = asyncio.run(server_runtime.score(tokens))
    broken = RunStorage(str(tmp_path), "broken")
    broken.write_atomic(broken.path("weights", "000002", "model.safetensors"), b"not safetensors")
    broken.mark_stable(broken.path("weights", "000002"))
    with pytest.raises(BroadcastError, match=r"step 2 to the vllm server"):
        asyncio.run(broadcast_weights(server_runtime, broken, 2))
    # resumed after the failed reload: the server still answers, on the old weights
    np.testing.assert_array_equal(asyncio.run(server_runtime.score(tokens)), before)
    assert server_runtime.policy_step == 0
    try:
        asyncio.run(broadcast_weights(server_runtime, updated_weights, UPDATED_STEP))
        assert server_runtime.policy_step == UPDATED_STEP
        new_dir = updated_weights.path("weights", f"{UPDATED_STEP:06d}")
        np.testing.assert_allclose(asyncio.run(server_runtime.score(tokens)), trainer_logprobs(new_dir, tokens, 1.0),
                                   atol=TOLERANCE)
    finally:
        asyncio.run(server_runtime.load_weights(tiny_model_path, 0))
