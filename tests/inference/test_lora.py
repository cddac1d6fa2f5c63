"""LoRA policies in the samplers: after each broadcast, the step's adapter (and only it) serves, with logprobs
that match a transformers + peft recomputation; the base model stays reachable without the adapter."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import LORA_RANK
from tests.inference.conftest import ADAPTER_RANK, LORA_STEPS, peft_logprobs, trainer_logprobs
from trace_rl.config import LoraConfig
from trace_rl.inference.broadcast import BroadcastError, broadcast_weights
from trace_rl.inference.build import BaseModelView, build_runtime
from trace_rl.models.runtime import RuntimeConfig

TOLERANCE = 2e-4  # the full-weight samplers' tolerance (tests/inference/test_samplers.py)
TEMPERATURE = 0.7


def adapter_dir(storage, step: int) -> str:
    return storage.path("weights", f"{step:06d}")


def check_serves_each_step(runtime, storage, base_dir: str, prompt_ids: list[int]) -> None:
    """Broadcast every step's adapter; each time sampled and scored logprobs match base + that adapter."""
    base_view = BaseModelView(RuntimeConfig(key="reference", name=base_dir, base_of="policy"), runtime)
    previous = None
    for step in range(1, LORA_STEPS + 1):
        asyncio.run(broadcast_weights(runtime, storage, step))
        assert runtime.policy_step == step
        generation = asyncio.run(runtime.generate(prompt_ids, temperature=TEMPERATURE, max_tokens=12, top_p=1.0,
                                                  seed=step))
        tokens = prompt_ids + generation.token_ids
        expected = peft_logprobs(base_dir, adapter_dir(storage, step), tokens, TEMPERATURE)
        np.testing.assert_allclose(generation.logprobs, expected[len(prompt_ids):], atol=TOLERANCE)
        np.testing.assert_allclose(asyncio.run(runtime.score(tokens)),
                                   peft_logprobs(base_dir, adapter_dir(storage, step), tokens, 1.0), atol=TOLERANCE)
        # the adapter changes the model, and each step's differs from the last
        base = trainer_logprobs(base_dir, tokens, TEMPERATURE)
        assert np.abs(expected - base).max() > 1e-2
        if previous is not None:
            assert np.abs(expected - peft_logprobs(base_dir, previous, tokens, TEMPERATURE)).max() > 1e-3
        previous = adapter_dir(storage, step)
        # the base model, from the same runtime, without the adapter
        np.testing.assert_allclose(asyncio.run(base_view.score(tokens, temperature=TEMPERATURE)), base,
                                   atol=TOLERANCE)


def lora_config(base_dir: str, backend: str, **fields) -> RuntimeConfig:
    return RuntimeConfig(key="policy", name=base_dir, backend=backend, lora=LoraConfig(rank=ADAPTER_RANK), **fields)


@pytest.mark.vllm
def test_vllm_engine_serves_each_steps_adapter(vllm_lora_runtime, lora_run, tiny_model_path, prompt_ids):
    runtime = vllm_lora_runtime
    try:
        check_serves_each_step(runtime, lora_run, tiny_model_path, prompt_ids)
        # one adapter in the engine: each broadcast removed the previous one
        loaded = set(runtime.worker.call(lambda llm: llm.llm_engine.list_loras()).result(60))
        assert loaded == {runtime.adapter.lora_int_id}
        assert runtime.adapter.lora_name.startswith(f"policy-step-{LORA_STEPS}-")
    finally:
        asyncio.run(runtime.load_weights(tiny_model_path, 0))
    # the base weights again: no adapter left, the base model's logprobs
    assert runtime.adapter is None and not runtime.worker.call(lambda llm: llm.llm_engine.list_loras()).result(60)
    tokens = prompt_ids + [70, 71]
    np.testing.assert_allclose(asyncio.run(runtime.score(tokens)), trainer_logprobs(tiny_model_path, tokens, 1.0),
                               atol=TOLERANCE)


@pytest.mark.vllm
def test_an_adapter_above_the_engines_rank_is_refused_before_it_reaches_vllm(vllm_lora_runtime, tmp_path, lora_run,
                                                                             tiny_model_path, prompt_ids):
    import json
    import shutil

    from trace_rl.storage import RunStorage

    storage = RunStorage(str(tmp_path), "too-big")
    target = storage.path("weights", "000001")
    shutil.copytree(adapter_dir(lora_run, 1), target)
    config_path = Path(target) / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "r": 64}))
    storage.mark_stable(target)
    with pytest.raises(BroadcastError, match=rf"rank 64, above the {LORA_RANK} the sampler serves"):
        asyncio.run(broadcast_weights(vllm_lora_runtime, storage, 1))
    tokens = prompt_ids + [70]
    np.testing.assert_allclose(asyncio.run(vllm_lora_runtime.score(tokens)),
                               trainer_logprobs(tiny_model_path, tokens, 1.0), atol=TOLERANCE)


def test_transformers_sampler_runs_the_peft_model(lora_run, tiny_model_path, prompt_ids):
    runtime = build_runtime(lora_config(tiny_model_path, "hf"))
    assert runtime.peft is not None and not runtime.adapter_loaded
    check_serves_each_step(runtime, lora_run, tiny_model_path, prompt_ids)
    asyncio.run(runtime.load_weights(tiny_model_path, 0))
    tokens = prompt_ids + [70, 71]
    np.testing.assert_allclose(asyncio.run(runtime.score(tokens)), trainer_logprobs(tiny_model_path, tokens, 1.0),
                               atol=TOLERANCE)


def test_a_reference_that_is_the_policys_base_is_served_by_the_policy_without_adapter(tiny_model_path, tmp_path):
    from trace_rl.config import Config
    from trace_rl.pipeline.session import LazyRuntimes

    def config(lora):
        return Config(name="ref", storage=str(tmp_path), env=[{"id": "reverse-text"}],
                      model={"name": tiny_model_path, "lora": lora}, inference={"backend": "hf"},
                      models={"reference": {"name": tiny_model_path, "tokens": True},
                              "other": {"name": "tiny", "tokens": True}})

    runtimes = LazyRuntimes(config({"rank": 4}))
    assert runtimes.configs["reference"].base_of == "policy" and runtimes.configs["other"].base_of is None
    reference = runtimes["reference"]
    assert isinstance(reference, BaseModelView) and reference.lora_runtime is runtimes["policy"]
    with pytest.raises(TypeError, match="base model of the LoRA-trained 'policy'"):
        asyncio.run(reference.load_weights(tiny_model_path, 1))
    # without LoRA the reference is a model of its own
    assert LazyRuntimes(config(None)).configs["reference"].base_of is None


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_server_serves_each_steps_adapter(vllm_server, lora_run, tiny_model_path, prompt_ids):
    runtime = build_runtime(lora_config(tiny_model_path, "vllm", base_urls=[vllm_server.url]))
    check_serves_each_step(runtime, lora_run, tiny_model_path, prompt_ids)
    served = [m["id"] for m in httpx.get(f"{vllm_server.url}/v1/models").json()["data"]]
    # the base model and the last step's adapter; the earlier ones were unloaded
    assert len(served) == 2 and runtime.adapter in served and runtime.adapter.startswith(f"policy-step-{LORA_STEPS}-")
