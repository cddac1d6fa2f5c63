import asyncio

import numpy as np
import pytest

from trace_rl.algorithms import AlgorithmError, load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.data.trace import Branch, Trace

from tests.algorithms.helpers import run

TEMPERATURE = 0.7


class Observed:
    """A real runtime whose score calls are watched: how many run at once, which endpoints, which temperatures."""

    def __init__(self, runtime, num_endpoints=1):
        self.runtime, self.num_endpoints = runtime, num_endpoints
        self.key, self.config, self.tokenizer = runtime.key, runtime.config, runtime.tokenizer
        self.in_flight = self.max_in_flight = 0
        self.endpoints, self.temperatures = [], []

    async def score(self, token_ids, *, temperature=1.0, endpoint=0):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.endpoints.append(endpoint)
        self.temperatures.append(temperature)
        try:
            return await self.runtime.score(token_ids, temperature=temperature)
        finally:
            self.in_flight -= 1


def rollout(policy, trace_id, seed, group="g0", **kw):
    """A real single-turn rollout of the tiny policy: prompt tokens, then sampled tokens with their logprobs."""
    prompt = policy.tokenizer(policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "abc"}], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    prompt_ids = prompt["input_ids"]
    generation = run(policy.generate(prompt_ids, temperature=TEMPERATURE, max_tokens=6, top_p=1.0, seed=seed))
    n_prompt, n_out = len(prompt_ids), len(generation.token_ids)
    branch = Branch(
        token_ids=prompt_ids + generation.token_ids, sampled=[False] * n_prompt + [True] * n_out,
        logprobs=[0.0] * n_prompt + generation.logprobs, message_index=[0] * n_prompt + [1] * n_out,
        is_content=[True] * (n_prompt + n_out), temperature=TEMPERATURE,
    )
    answer = policy.tokenizer.decode(generation.token_ids)
    return Trace(id=trace_id, env="toy", example_id="e0", group_id=group, branches=[branch],
                 messages=[{"role": "user", "content": "abc"}, {"role": "assistant", "content": answer}], **kw)


@pytest.fixture(scope="module")
def rollouts(policy_runtime):
    return [rollout(policy_runtime, f"t{i}", seed=i, group=f"g{i % 2}") for i in range(8)]


async def distill(spec, models, traces):
    algorithm = load_algorithm(spec)
    await algorithm.setup(models)
    return await apply_algorithm(algorithm, traces)


def test_opd_advantage_is_reference_minus_inference_logprob(rollouts, reference_runtime):
    channels = run(distill("opd", {"reference": reference_runtime}, rollouts[:2]))
    assert [c.trace_id for c in channels] == ["t0", "t1"]
    for channel, trace in zip(channels, rollouts):
        branch = trace.branches[0]
        reference = run(reference_runtime.score(branch.token_ids.tolist(), temperature=TEMPERATURE))
        expected = np.where(branch.sampled, reference - branch.logprobs, 0.0)
        assert channel.loss == "rl"
        np.testing.assert_array_equal(channel.mask, branch.sampled)
        np.testing.assert_allclose(channel.values, expected, atol=1e-6)
        assert np.abs(channel.values).max() > 0.01  # two different models do disagree


def test_opd_scores_at_the_branch_temperature_by_default(rollouts, policy_runtime):
    """Against the sampling model itself, scoring at the sampling temperature gives ~0; at 1.0 it does not."""
    [same] = run(distill({"id": "opd", "model": "policy"}, {"policy": policy_runtime}, rollouts[:1]))
    np.testing.assert_allclose(same.values, 0.0, atol=1e-4)
    [raw] = run(distill({"id": "opd", "model": "policy", "temperature": 1.0}, {"policy": policy_runtime}, rollouts[:1]))
    assert np.abs(raw.values[raw.mask]).max() > 1e-2


def test_opd_bounds_concurrency_and_spreads_over_endpoints(rollouts, reference_runtime):
    observed = Observed(reference_runtime, num_endpoints=3)
    channels = run(distill({"id": "opd", "max_concurrent": 3}, {"reference": observed}, rollouts))
    assert len(channels) == 8
    assert observed.max_in_flight == 3  # both groups' calls share the bound, and the bound is reached
    assert sorted(observed.endpoints) == [0, 0, 0, 1, 1, 1, 2, 2]
    assert observed.temperatures == [TEMPERATURE] * 8


def test_opd_default_bound_is_32(reference_runtime):
    assert load_algorithm("opd").options.max_concurrent == 32


def test_opd_skips_untrainable_and_errored_traces_without_scoring(policy_runtime, reference_runtime):
    traces = [rollout(policy_runtime, "judge", 0, trainable=False), rollout(policy_runtime, "bad", 1, error="x")]
    observed = Observed(reference_runtime)
    assert run(distill("opd", {"reference": observed}, traces)) == []
    assert observed.endpoints == []


def test_opd_needs_its_model_at_setup():
    with pytest.raises(AlgorithmError, match=r"'opd' scores with model 'reference', but only \['policy'\] are running"):
        run(load_algorithm("opd").setup({"policy": object()}))


def hint_ids(tokenizer, demonstration):
    text = f"<|im_start|>system\nA worked solution to the task that follows:\n{demonstration}<|im_end|>\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("info, shown", [({"answer": "cba"}, "cba"),
                                         ({"demonstration": "c-b-a", "answer": "cba"}, "c-b-a")])
def test_opsd_scores_the_branch_after_a_hint_block(policy_runtime, info, shown):
    trace = rollout(policy_runtime, "t", seed=3, info=info)
    [channel] = run(distill("opsd", {"policy": policy_runtime}, [trace]))
    branch = trace.branches[0]
    hint = hint_ids(policy_runtime.tokenizer, shown)
    teacher = run(policy_runtime.score(hint + branch.token_ids.tolist(), temperature=TEMPERATURE))[len(hint):]
    np.testing.assert_allclose(channel.values, np.where(branch.sampled, teacher - branch.logprobs, 0.0), atol=1e-6)
    np.testing.assert_array_equal(channel.mask, branch.sampled)
    assert np.abs(channel.values).max() > 1e-3  # the hint changes the teacher's view


def test_opsd_without_a_demonstration_names_the_trace(policy_runtime):
    traces = [rollout(policy_runtime, "has", 0, info={"answer": "x"}), rollout(policy_runtime, "lacks", 1)]
    with pytest.raises(AlgorithmError, match=r"opsd: trace 'lacks' \(env 'toy', example 'e0'\) has neither "
                                             r"info\['demonstration'\] nor info\['answer'\]"):
        run(distill("opsd", {"policy": policy_runtime}, traces))


def test_opsd_hint_must_show_the_demonstration():
    with pytest.raises(AlgorithmError, match=r"algorithm 'opsd': hint: hint must contain '\{demonstration\}'"):
        load_algorithm({"id": "opsd", "hint": "no placeholder"})


def test_semaphore_follows_the_event_loop(reference_runtime, rollouts):
    """The same algorithm instance runs in a fresh event loop each step."""
    algorithm = load_algorithm({"id": "opd", "max_concurrent": 2})
    run(algorithm.setup({"reference": reference_runtime}))
    for _ in range(2):
        assert len(asyncio.run(apply_algorithm(algorithm, rollouts[:2]))) == 2
