"""The vLLM engine takes the requests a step sends together as one group, however they arrive: all of them reach
its engine core while its scheduler is paused, in the order of what they ask (seed, then prompt), so its first
engine step batches the same requests in the same rows on every run."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.vllm

SEEDS = [104, 101, 103, 100, 102]


def recorded_engine_calls(engine) -> tuple[list, callable]:
    """Wrap the engine's add_request and its core's utility calls to record, in order, each call's name (and
    a request's seed); returns the record and a function that unwraps them."""
    calls: list = []
    add_request, call_utility = engine.add_request, engine.engine_core.call_utility

    def recording_add(request_id, prompt, params, **kwargs):
        calls.append(("add", params.seed))
        return add_request(request_id, prompt, params, **kwargs)

    def recording_utility(method, *args):
        calls.append((method,))
        return call_utility(method, *args)

    engine.add_request, engine.engine_core.call_utility = recording_add, recording_utility

    def unwrap():
        del engine.add_request, engine.engine_core.call_utility

    return calls, unwrap


def test_requests_sent_together_reach_the_engine_as_one_ordered_group_however_they_arrive(vllm_runtime, prompt_ids):
    engine = vllm_runtime.worker.llm.llm_engine

    async def rollout(rank: int, seed: int):
        for _ in range(rank):
            await asyncio.sleep(0)
        time.sleep(0.02)  # a slow env, or a loaded machine: the engine core would have started on the first
        return await vllm_runtime.generate(prompt_ids, temperature=1.0, max_tokens=8, seed=seed)

    async def step(seeds: list[int]):
        return await asyncio.gather(*(rollout(rank, seed) for rank, seed in enumerate(seeds)))

    results, records = [], []
    for seeds in (SEEDS, SEEDS[::-1]):
        calls, unwrap = recorded_engine_calls(engine)
        try:
            generations = asyncio.run(step(seeds))
        finally:
            unwrap()
        results.append({seed: (g.token_ids, g.logprobs) for seed, g in zip(seeds, generations, strict=True)})
        records.append(calls)
    for calls in records:
        assert calls == [("pause_scheduler",), *(("add", seed) for seed in sorted(SEEDS)), ("resume_scheduler",)]
    assert results[0] == results[1]  # bit for bit
    assert len({tuple(tokens) for tokens, _ in results[0].values()}) > 1  # the seeds sampled different completions
