"""Runtimes for environment tests: the real samplers on the tiny model, a scripted one for
steering an episode, and a wrapper that fails on purpose."""

from __future__ import annotations

import asyncio

import pytest

from trace_rl.inference.build import build_runtime
from trace_rl.models.runtime import Generation, RuntimeConfig

VLLM_FIXTURE = "vllm_runtime"  # the session vLLM engine on the tiny model (tests/conftest.py)


@pytest.fixture(scope="session")
def hf_runtime(tiny_model_path):
    return build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf", max_model_len=1024))


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def runtime(request):
    """Each real sampler in turn."""
    if request.param == "hf":
        return request.getfixturevalue("hf_runtime")
    return request.getfixturevalue(VLLM_FIXTURE)


class ScriptedRuntime:
    """Answers with fixed replies (in order, each ending with the end-of-turn token) to steer an episode."""

    num_endpoints = 1
    policy_step = 0

    def __init__(self, tokenizer, replies: list[str]):
        self.key = "policy"
        self.config = RuntimeConfig(key="policy", name="scripted", max_model_len=1024)
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, *, temperature, max_tokens, top_p, seed, stop=()) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Generation(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop")


class FailingRuntime:
    """Wraps a real runtime; raises `error` on the first `failures` generate calls (all if None), or
    sleeps `delay_s` before each call."""

    def __init__(self, inner, error: Exception | None = None, failures: int | None = None, delay_s: float = 0.0):
        self.inner = inner
        self.key, self.config, self.tokenizer = inner.key, inner.config, inner.tokenizer
        self.policy_step = inner.policy_step
        self.num_endpoints = 1
        self.error, self.failures, self.delay_s = error, failures, delay_s
        self.calls = 0

    async def generate(self, prompt_ids, **kwargs) -> Generation:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.error is not None and (self.failures is None or self.calls <= self.failures):
            raise self.error
        return await self.inner.generate(prompt_ids, **kwargs)
