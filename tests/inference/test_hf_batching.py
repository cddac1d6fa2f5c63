"""The transformers sampler decodes concurrent requests as one left-padded batch: every request gets what it
would get alone (same tokens under its seed, logprobs within 1e-5 in float32), its own stop and budget, and the
logprobs of the sampled tokens equal the score path's."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from trace_rl.inference.batcher import RequestBatcher
from trace_rl.inference.hf_decode import Request, decode_batch, nucleus_logprobs

EXACT = 1e-5  # float32: batched rows vs a one-row batch differ only by GEMM rounding


def prompts_of_many_lengths(prompt_ids: list[int]) -> list[list[int]]:
    """Eight prompts from 3 to len(prompt_ids) + 7 tokens, so the batch needs left padding."""
    return [prompt_ids[: 3 + 4 * i] if i < 4 else prompt_ids + [40 + i] * (i - 1) for i in range(8)]


def settings(i: int) -> dict:
    return {"temperature": (1.0, 0.7, 1.3)[i % 3], "top_p": (1.0, 0.8)[i % 2], "max_tokens": 6 + 3 * i,
            "seed": 100 + i}


def recorded_batches(runtime) -> list[int]:
    """Wrap the runtime's batch function to record the size of each batch it decodes."""
    sizes: list[int] = []
    decode = runtime._batcher._run_batch

    def recording(requests, futures):
        sizes.append(len(requests))
        decode(requests, futures)

    runtime._batcher._run_batch = recording
    return sizes


@pytest.fixture
def batch_sizes(hf_runtime):
    decode = hf_runtime._batcher._run_batch
    yield recorded_batches(hf_runtime)
    hf_runtime._batcher._run_batch = decode


def test_concurrent_requests_decode_as_one_batch_and_match_one_at_a_time(hf_runtime, prompt_ids, batch_sizes):
    prompts = prompts_of_many_lengths(prompt_ids)

    async def main():
        return await asyncio.gather(*(hf_runtime.generate(p, **settings(i)) for i, p in enumerate(prompts)))

    batched = asyncio.run(main())
    assert batch_sizes == [8]
    pad = hf_runtime.stop_token_ids[0]
    for i, prompt in enumerate(prompts):
        (alone,) = decode_batch(hf_runtime.model, [Request(prompt, **settings(i))],
                                stop_ids=hf_runtime.stop_token_ids, pad_id=pad)
        assert batched[i].token_ids == alone.token_ids
        assert batched[i].finish_reason == alone.finish_reason
        np.testing.assert_allclose(batched[i].logprobs, alone.logprobs, atol=EXACT, rtol=0)
        assert len(alone.token_ids) == settings(i)["max_tokens"] or alone.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_batched_logprobs_equal_the_score_path(hf_runtime, prompt_ids, temperature):
    prompts = prompts_of_many_lengths(prompt_ids)

    async def main():
        return await asyncio.gather(*(hf_runtime.generate(p, temperature=temperature, top_p=1.0, max_tokens=20,
                                                          seed=i) for i, p in enumerate(prompts)))

    for prompt, generation in zip(prompts, asyncio.run(main()), strict=True):
        scored = asyncio.run(hf_runtime.score(prompt + generation.token_ids, temperature=temperature))
        np.testing.assert_allclose(generation.logprobs, scored[len(prompt):], atol=EXACT, rtol=0)


def test_each_row_stops_on_its_own(tiny_model_path, prompt_ids):
    """With 'e' as a second stop token, rows end at different steps; every other row goes on to its budget."""
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig

    runtime = build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf",
                                          stop_tokens=["<|im_end|>", "e"]))
    requests = [Request(prompt_ids, temperature=1.5, top_p=1.0, max_tokens=40, seed=s) for s in range(12)]
    generations = decode_batch(runtime.model, requests, stop_ids=runtime.stop_token_ids, pad_id=0)
    lengths = {len(g.token_ids) for g in generations if g.finish_reason == "stop"}
    assert len(lengths) > 1
    for generation in generations:
        assert all(t not in runtime.stop_token_ids for t in generation.token_ids[:-1])
        if generation.finish_reason == "stop":
            assert generation.token_ids[-1] in runtime.stop_token_ids
        else:
            assert len(generation.token_ids) == 40


def test_nucleus_logprobs_per_row():
    """Row 0 keeps everything (top_p 1); row 1 keeps the smallest set above 0.7 probability, renormalized."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 2, dtype=np.float32))
    import torch

    out = nucleus_logprobs(torch.from_numpy(logits), torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.7])).exp()
    np.testing.assert_allclose(out[0].numpy(), [0.5, 0.3, 0.15, 0.05], atol=1e-6)
    np.testing.assert_allclose(out[1].numpy(), [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0], atol=1e-6)


def test_turns_that_finish_together_form_the_next_batch():
    """Two-turn rollouts: the first turns go out together, and so do the second turns they lead to."""
    batches: list[list[str]] = []

    def run_batch(requests, futures):
        batches.append(list(requests))
        for request, future in zip(requests, futures, strict=True):
            future.set_result(request.upper())

    batcher = RequestBatcher(run_batch)

    async def rollout(i: int) -> list[str]:
        first = await asyncio.wrap_future(batcher.submit(f"r{i}t0"))
        second = await asyncio.wrap_future(batcher.submit(f"r{i}t1"))
        return [first, second]

    async def main():
        return await asyncio.gather(*(rollout(i) for i in range(6)))

    results = asyncio.run(main())
    assert results == [[f"R{i}T0", f"R{i}T1"] for i in range(6)]
    assert batches == [[f"r{i}t0" for i in range(6)], [f"r{i}t1" for i in range(6)]]


def test_a_failed_batch_fails_each_of_its_requests():
    release = threading.Event()

    def run_batch(requests, futures):
        release.wait(5)
        raise RuntimeError("model exploded")

    batcher = RequestBatcher(run_batch)
    futures = [batcher.submit(i) for i in range(3)]
    release.set()
    for future in futures:
        with pytest.raises(RuntimeError, match="model exploded"):
            future.result(timeout=10)


def test_an_idle_worker_exits_and_the_next_request_starts_another():
    batcher = RequestBatcher(lambda requests, futures: [f.set_result(r * 2) for r, f in zip(requests, futures)],
                             idle_exit_s=0.05, name="idle-exit-test")

    def workers() -> int:
        return sum(thread.name == "idle-exit-test" for thread in threading.enumerate())

    assert batcher.submit(1).result(timeout=10) == 2 and workers() == 1
    deadline = time.monotonic() + 10
    while workers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert workers() == 0
    assert batcher.submit(2).result(timeout=10) == 4


def test_a_batch_is_what_the_loop_submits_before_it_waits_however_slow_it_runs():
    """Arrival times do not split a batch: rollouts that each spend 20 ms of the loop's time (4x `settle_s`), and a
    few loop passes, before their request still go out together, as do the turns their results lead to."""
    batches: list[list[str]] = []

    def run_batch(requests, futures):
        batches.append(list(requests))
        for request, future in zip(requests, futures, strict=True):
            future.set_result(request)

    batcher = RequestBatcher(run_batch, settle_s=0.005, max_wait_s=0.05)

    async def rollout(i: int) -> None:
        for turn in range(2):
            for _ in range(i):
                await asyncio.sleep(0)
            time.sleep(0.02)  # a slow env, or a loaded machine
            await asyncio.wrap_future(batcher.submit(f"r{i}t{turn}"))

    async def main():
        await asyncio.gather(*(rollout(i) for i in range(5)))

    asyncio.run(main())
    assert batches == [[f"r{i}t0" for i in range(5)], [f"r{i}t1" for i in range(5)]]


def test_the_same_requests_in_another_arrival_order_decode_bit_for_bit_the_same(hf_runtime, prompt_ids):
    """Rows go by what a request asks, not by when it arrived (rollouts waiting on a sandbox arrive in another order
    on each run): a row's GEMM rounding can depend on its position in the batch, seen on a Zen 5."""
    prompt = prompt_ids[:12]  # one length: no padding, only the rows' order differs

    def decoded(order: list[int]) -> dict[int, tuple]:
        futures = [Future() for _ in order]
        hf_runtime._decode([Request(list(prompt), temperature=1.0, top_p=1.0, max_tokens=8, seed=500 + i)
                            for i in order], futures)
        return {i: (tuple(f.result().token_ids), tuple(f.result().logprobs)) for i, f in zip(order, futures)}

    orders = [list(range(8)), [3, 7, 0, 5, 1, 6, 2, 4], list(range(8))[::-1]]
    first, *others = (decoded(order) for order in orders)
    assert all(other == first for other in others)
    assert len({tokens for tokens, _ in first.values()}) > 1  # the seeds sampled different completions
