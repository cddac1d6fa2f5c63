"""Runtime configs from a run config, and the runtime each one builds."""

from __future__ import annotations

import asyncio

import pytest

from trace_rl.inference.build import TokenlessRuntime, build_runtime
from trace_rl.inference.hf import HFRuntime
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.pipeline.colocation import runtime_configs
from trace_rl.runs.loading import validate_config


def test_runtime_configs_from_run_config():
    config = validate_config({
        "name": "r", "seed": 4, "env": [{"id": "reverse-text"}],
        "model": {"name": "tiny", "dtype": "bfloat16"},
        "inference": {"backend": "hf", "max_model_len": 512, "cpu_kv_cache_gb": 2.0},
        "models": {
            "reference": {"name": "tiny", "tokens": True},
            "teacher": {"name": "tiny", "seed": 9, "tokens": True, "base_url": ["http://a:1", "http://b:2"]},
            "judge": {"name": "some/model"},
        },
    })
    configs = runtime_configs(config)
    assert set(configs) == {"policy", "reference", "teacher", "judge"}
    policy = configs["policy"]
    assert (policy.name, policy.dtype, policy.backend, policy.max_model_len, policy.cpu_kv_cache_gb) == (
        "tiny", "bfloat16", "hf", 512, 2.0)
    assert policy.base_urls == [] and policy.tokens
    assert configs["reference"].name == "tiny:5"  # run seed + 1: differs from the policy
    assert configs["teacher"].name == "tiny:9" and configs["teacher"].base_urls == ["http://a:1", "http://b:2"]
    assert not configs["judge"].tokens
    assert RuntimeConfig.model_validate_json(policy.model_dump_json()) == policy  # plain data across processes


def test_build_runtime_picks_backend_and_rejects_tokenless_models(tiny_model_path):
    assert isinstance(build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf")), HFRuntime)
    judge = build_runtime(RuntimeConfig(key="judge", name="some/model", tokens=False))
    assert isinstance(judge, TokenlessRuntime)
    with pytest.raises(TypeError, match=r"'judge' is not token-capable.*tokens = true in \[models.judge\]"):
        asyncio.run(judge.generate([1, 2], temperature=1.0, max_tokens=4, top_p=1.0, seed=0))
    with pytest.raises(TypeError, match="cannot score"):
        asyncio.run(judge.score([1, 2]))
