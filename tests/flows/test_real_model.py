"""The path a researcher takes with a real chat model, on the realistic fixture: a Hub id resolved offline, bf16,
the in-process vLLM sampler, a tool-calling env, through the Prefect flow; the sampler and the trainer agree."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors import safe_open

from tests.conftest import VLLM_ENGINE
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage

MAX_MEAN_ABS_LOGPROB_DIFF = 1e-2


@pytest.mark.slow
@pytest.mark.vllm
def test_hub_model_in_bf16_on_vllm_trains_a_tool_env_with_small_mismatch(prefect_api, realistic_model, tmp_path):
    from flows.train import run_training

    config = validate_config({
        "name": "real-model", "steps": 2, "seed": 1, "storage": str(tmp_path),
        "model": {"name": realistic_model.repo_id, "dtype": "bfloat16"},
        "inference": {"backend": "vllm", **VLLM_ENGINE},
        "sampling": {"temperature": 0.7, "max_completion_tokens": 16},
        "algorithms": ["grpo", {"id": "echo", "tool": {"alpha": 0.1}, "include_prompt": True}],
        # small: bfloat16 matmuls run at about 1 GFLOP/s on a CPU without bf16 units (AVX2), so the trainer's steps
        # on the 152k-token vocabulary are most of the test's time
        "env": [{"id": "link-nav", "batch_size": 1, "group_size": 2, "args": {"pages": 5, "max_turns": 2}}],
        "trainer": {"lr": 1e-5, "micro_batch_tokens": 2048},
    })
    run_training(config)

    storage = RunStorage(config.storage, config.name)
    assert storage.stable_steps("weights") == [1, 2]
    for step in (1, 2):
        metrics = storage.read_json(storage.step_path(step, "metrics.json"))
        assert metrics["rollouts/link-nav/errors"] == 0
        assert metrics["train/tokens/rl"] > 0 and metrics["train/tokens/ce"] > 0  # tool results trained by echo
        assert 0 < metrics["train/mismatch/mean_abs_logprob_diff"] < MAX_MEAN_ABS_LOGPROB_DIFF, metrics
        assert np.isfinite(metrics["train/mismatch/k3_kl"]) and metrics["train/grad_norm"] > 0
    with safe_open(f"{storage.path('weights', '000002')}/model.safetensors", "pt") as weights:
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert str(embedding.dtype) == "torch.bfloat16" and embedding.shape[0] == 151936
