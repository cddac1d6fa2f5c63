"""The in-process samplers (transformers and vLLM) on the tiny model: sampled tokens with
processed logprobs that match the trainer's, reproducible per seed, and scoring."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.inference.conftest import trainer_logprobs

TOLERANCE = 2e-4  # fp32 logprobs of two implementations of the same forward pass


def test_generate_returns_tokens_with_logprobs_reproducibly(runtime, prompt_ids):
    async def sample(seed):
        return await runtime.generate(prompt_ids, temperature=1.0, max_tokens=12, top_p=1.0, seed=seed)

    async def main():
        return await asyncio.gather(sample(7), sample(7), sample(8))

    first, again, other = asyncio.run(main())
    assert len(first.token_ids) == len(first.logprobs) == 12
    assert first.finish_reason == "length"
    assert all(lp < 0 for lp in first.logprobs)
    assert first.token_ids == again.token_ids
    # hf decodes the three as one batch, where equal rows may differ by GEMM rounding (test_hf_batching.py)
    np.testing.assert_allclose(first.logprobs, again.logprobs, atol=1e-5, rtol=0)
    assert other.token_ids != first.token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_trainer(runtime, prompt_ids, tiny_model_path, temperature):
    generation = asyncio.run(runtime.generate(prompt_ids, temperature=temperature, max_tokens=16, top_p=1.0, seed=3))
    expected = trainer_logprobs(tiny_model_path, prompt_ids + generation.token_ids, temperature)
    np.testing.assert_allclose(generation.logprobs, expected[len(prompt_ids):], atol=TOLERANCE)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_score_matches_trainer(runtime, prompt_ids, tiny_model_path, temperature):
    tokens = prompt_ids + [ord(c) - 32 for c in "olleh"]  # any ids; the tiny model's bytes are shifted
    scores = asyncio.run(runtime.score(tokens, temperature=temperature))
    assert scores.dtype == np.float32 and scores.shape == (len(tokens),) and scores[0] == 0.0
    np.testing.assert_allclose(scores, trainer_logprobs(tiny_model_path, tokens, temperature), atol=TOLERANCE)


def test_top_p_logprobs_are_renormalized_over_the_kept_tokens(runtime, prompt_ids, tiny_model_path):
    """Processed logprobs come after top-p: every sampled token is more likely than without the filter."""
    generation = asyncio.run(runtime.generate(prompt_ids, temperature=1.0, max_tokens=16, top_p=0.5, seed=5))
    unfiltered = trainer_logprobs(tiny_model_path, prompt_ids + generation.token_ids, 1.0)[len(prompt_ids):]
    assert np.all(np.asarray(generation.logprobs) > unfiltered + 0.1)


def test_vllm_and_hf_agree_on_scores(hf_runtime, vllm_runtime, prompt_ids):
    tokens = prompt_ids + [60, 61, 62]
    hf, vllm = (asyncio.run(r.score(tokens)) for r in (hf_runtime, vllm_runtime))
    np.testing.assert_allclose(hf, vllm, atol=TOLERANCE)


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_configured_stop_tokens_end_a_turn(backend, tiny_model_path, prompt_ids, request):
    """A second stop token ends generation as the eos token does, in every sampler (vLLM: the session engine)."""
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig

    if backend == "vllm":
        request.getfixturevalue("vllm_runtime")  # the engine this runtime shares
    from tests.conftest import VLLM_ENGINE

    runtime = build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend=backend,
                                          stop_tokens=["<|im_end|>", "e"], **VLLM_ENGINE))
    tokenizer = runtime.tokenizer
    assert runtime.stop_token_ids == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("e")]
    ended = [asyncio.run(runtime.generate(prompt_ids, temperature=1.5, max_tokens=64, top_p=1.0, seed=seed))
             for seed in range(8)]
    stopped = [g for g in ended if g.finish_reason == "stop"]
    assert stopped and all(g.token_ids[-1] in runtime.stop_token_ids for g in stopped)
    assert all(t not in runtime.stop_token_ids for g in ended for t in g.token_ids[:-1])


def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it(runtime, prompt_ids):
    assert_stop_strings_cut_turns(runtime, prompt_ids)


def assert_stop_strings_cut_turns(runtime, prompt_ids: list[int]) -> None:
    """Under the same seed, a turn with a stop string is the turn without it cut right after the first token
    whose text completes the string, with the same logprobs; a turn that never spells it is unchanged."""
    text = lambda ids: runtime.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    def sample(seed: int, stop: list[str] = ()):
        return asyncio.run(runtime.generate(prompt_ids, temperature=1.5, max_tokens=40, top_p=1.0, seed=seed,
                                            stop=stop))

    free = {seed: sample(seed) for seed in range(6)}
    # a piece of seed 0's text, two tokens of two or more whole characters, from its 3rd token on
    ids = free[0].token_ids
    stop = next(piece for i in range(2, len(ids) - 2)
                if len(piece := text(ids[i:i + 2])) >= 2 and "\ufffd" not in piece)
    cut_short = 0
    for seed, whole in free.items():
        ends = [k for k in range(1, len(whole.token_ids) + 1) if stop in text(whole.token_ids[:k])]
        stopped = sample(seed, [stop, "never spelled \u2603"])
        if ends:
            assert stopped.token_ids == whole.token_ids[:ends[0]] and stopped.finish_reason == "stop", seed
            cut_short += ends[0] < len(whole.token_ids)
        else:
            assert stopped.token_ids == whole.token_ids and stopped.finish_reason == whole.finish_reason, seed
        np.testing.assert_allclose(stopped.logprobs, whole.logprobs[:len(stopped.token_ids)], atol=1e-6, rtol=0)
    assert cut_short >= 1


def test_env_sampling_stop_strings_reach_the_sampler(hf_runtime, prompt_ids):
    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Sampler

    def turn(stop: list[str]):
        sampling = SamplingConfig(temperature=1.5, max_completion_tokens=40, stop=stop)
        return asyncio.run(Sampler(hf_runtime, sampling, seed=7).generate(prompt_ids, seed=7))

    whole = turn([])
    stop = hf_runtime.tokenizer.decode(whole.token_ids[:3], skip_special_tokens=True)
    stopped = turn([stop])
    assert stopped.finish_reason == "stop" and 1 <= len(stopped.token_ids) <= 3
    assert stopped.token_ids == whole.token_ids[:len(stopped.token_ids)]
