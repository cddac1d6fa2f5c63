"""The rollout loop: groups, ids, seeds, per-env temperature, retries with backoff, error traces."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest
from pydantic import BaseModel

from tests.envs.conftest import FailingRuntime
from trace_rl.config import Config
from trace_rl.data.trace import Message, TraceError, group_traces
from trace_rl.envs.base import Environment, Example
from trace_rl.errors import RetryableError
from trace_rl.pipeline.rollouts import RolloutError, play_rollouts


def make_config(**inference) -> Config:
    return Config(
        name="rollouts-test", seed=5,
        sampling={"temperature": 1.0, "max_completion_tokens": 8},
        inference={"max_concurrent": 3, "max_retries": 3, "retry_backoff_s": 0.01, **inference},
        env=[
            {"id": "reverse-text", "batch_size": 2, "group_size": 2,
             "sampling": {"temperature": 0.7, "max_completion_tokens": 6}},
            {"id": "number-debate", "batch_size": 1, "group_size": 2, "args": {"rounds": 1}},
        ],
    )


def run(config: Config, runtime, step: int = 0):
    return asyncio.run(play_rollouts(config, {"policy": runtime}, step))


def test_groups_ids_temperatures_and_summary(runtime):
    traces, summary = run(make_config(), runtime)
    assert len(traces) == 2 * 2 + 1 * 2 * 2  # the debate gives two traces per rollout
    assert len({t.id for t in traces}) == len(traces)
    groups = group_traces(traces)
    assert [len(g) for g in groups.values()] == [2, 2, 4]
    for group in groups.values():
        assert len({(t.env, t.example_id) for t in group}) == 1
    reverse = [t for t in traces if t.env == "reverse-text"]
    debate = [t for t in traces if t.env == "number-debate"]
    assert {b.temperature for t in reverse for b in t.branches} == {0.7}
    assert {b.temperature for t in debate for b in t.branches} == {1.0}
    assert all(t.branches[0].sampled.sum() <= 6 for t in reverse)
    assert {t.policy_step for t in traces} == {runtime.policy_step}
    assert all(t.error is None for t in traces) and summary.retries == 0 and summary.errors == []
    rewards = np.array([t.reward for t in reverse])
    assert summary.envs["reverse-text"].reward_mean == pytest.approx(rewards.mean())
    assert summary.envs["reverse-text"].reward_std == pytest.approx(rewards.std())
    assert summary.metrics()["rollouts/number-debate/traces"] == 4.0
    exact = np.mean([t.metrics["exact"] for t in reverse])
    assert summary.metrics()["rollouts/reverse-text/metrics/exact"] == pytest.approx(exact)
    assert summary.metrics()["rollouts/number-debate/metrics/turns"] == 1.0  # each player's one round


def test_same_seed_and_step_same_traces(hf_runtime):
    config = make_config()
    first, _ = run(config, hf_runtime, step=1)
    again, _ = run(config, hf_runtime, step=1)
    assert all(a.equals(b) for a, b in zip(first, again, strict=True))
    later, _ = run(config, hf_runtime, step=2)
    assert [t.example_id for t in later] != [t.example_id for t in first]
    # rollouts of one example differ from each other (each has its own seed)
    a, b = first[:2]
    assert a.group_id == b.group_id and not np.array_equal(a.branches[0].token_ids, b.branches[0].token_ids)


def test_retryable_errors_are_retried_with_exponential_backoff(hf_runtime):
    config = make_config(max_concurrent=1)
    config.env = config.env[:1]
    config.env[0].batch_size, config.env[0].group_size = 1, 1
    flaky = FailingRuntime(hf_runtime, RetryableError("server 503"), failures=3)
    started = time.monotonic()
    traces, summary = run(config, flaky)
    assert time.monotonic() - started >= 0.01 + 0.02 + 0.04
    assert flaky.calls == 4 and summary.retries == 3
    assert traces[0].error is None
    clean, _ = run(config, hf_runtime)
    assert traces[0].equals(clean[0])  # a retry reruns the rollout with the same seeds


def test_timeouts_are_retryable_and_exhausted_retries_mark_the_trace(hf_runtime):
    config = make_config(max_retries=1, request_timeout_s=0.05)
    config.env = config.env[:1]
    config.env[0].batch_size, config.env[0].group_size = 1, 2
    config.env[0].max_error_fraction = 1.0  # every rollout fails on purpose
    slow = FailingRuntime(hf_runtime, delay_s=1.0)
    traces, summary = run(config, slow)
    assert slow.calls == 4  # two rollouts, two attempts each
    assert all(t.error == "gave up after 2 attempts: RetryableError: sampler timed out after 0.05s" for t in traces)
    assert summary.envs["reverse-text"].failed_groups == [traces[0].group_id]


def test_other_errors_mark_traces_and_failed_groups_are_reported(hf_runtime, caplog):
    config = make_config()
    for env in config.env:
        env.max_error_fraction = 1.0  # every rollout fails on purpose
    broken = FailingRuntime(hf_runtime, ValueError("bad prompt"))
    with caplog.at_level(logging.WARNING, logger="trace_rl.pipeline.rollouts"):
        traces, summary = run(config, broken)
    assert broken.calls == 2 * 2 + 2  # no retries: one call per rollout
    assert len(traces) == 6 and all(t.error == "ValueError: bad prompt" and not t.ok for t in traces)
    assert all(t.branches == [] and t.group_id and t.id for t in traces)
    assert summary.errors == ["ValueError: bad prompt"]
    failed = summary.envs["reverse-text"].failed_groups + summary.envs["number-debate"].failed_groups
    assert failed == list(group_traces(traces)) and len(failed) == 3
    assert sum("every rollout of group" in r.message for r in caplog.records) == 3
    assert summary.metrics()["rollouts/reverse-text/failed_groups"] == 2.0


class TwinAgents(Environment):
    """A two-play env: one agent, 'policy-agent', plays twice a rollout (best-of-n); `third` adds an agent named
    like its second play."""

    class Options(BaseModel):
        third: str | None = None

    def make_example(self, rng):
        return {}

    async def rollout(self, example, sampler):
        traces = []
        for agent, name in enumerate(["policy-agent", "policy-agent", *([self.args.third] if self.args.third else [])]):
            conversation = sampler.conversation([Message(role="user", content="hi")], agent=agent)
            await conversation.sample()
            traces.append(self.trace(example, conversation, agent=name))
        return traces


class FailingFirst(Environment):
    """Its first `failures` rollouts raise; the others sample one real turn."""

    class Options(BaseModel):
        failures: int

    calls = 0

    def make_example(self, rng):
        return {}

    async def rollout(self, example, sampler):
        self.calls += 1
        if self.calls <= self.args.failures:
            raise ValueError(f"broken rollout {self.calls}")
        conversation = sampler.conversation([Message(role="user", content="hi")])
        await conversation.sample()
        return [self.trace(example, conversation, reward=1.0)]


class SameExample(FailingFirst):
    """A buggy env: every example has the same id, so their groups would merge."""

    def examples(self, seed, count):
        return [Example(id="only", data={}) for _ in range(count)]


def env_config(env_class, batch_size=2, group_size=4, **fields) -> Config:
    return Config(name="rollouts-test", sampling={"max_completion_tokens": 4}, inference={"max_concurrent": 3},
                  env=[{"id": f"{__name__}:{env_class.__name__}", "batch_size": batch_size, "group_size": group_size,
                        **fields}])


def test_an_agent_that_plays_twice_in_a_rollout_gets_numbered_ids_and_colliding_ids_are_an_error(hf_runtime):
    traces, _ = run(env_config(TwinAgents, batch_size=1, group_size=2), hf_runtime, step=1)
    group = traces[0].group_id
    assert [t.id for t in traces] == [f"{group}-r0-policy-agent", f"{group}-r0-policy-agent-1",
                                      f"{group}-r1-policy-agent", f"{group}-r1-policy-agent-1"]
    assert {t.agent for t in traces} == {"policy-agent"}
    config = env_config(TwinAgents, batch_size=1, group_size=1, args={"third": "policy-agent-1"})
    with pytest.raises(TraceError, match=rf"env '{__name__}:TwinAgents' returned traces whose ids collide in one "
                                         r"rollout \(trace ids 'step1-.*-r0-policy-agent-1'\).*rename that agent"):
        run(config, hf_runtime, step=1)


def test_duplicate_example_ids_are_an_error_instead_of_merged_groups(hf_runtime):
    with pytest.raises(TraceError, match=rf"env '{__name__}:SameExample' returned the example ids 'only' more than "
                                         "once in one step"):
        run(env_config(SameExample, args={"failures": 0}), hf_runtime)


def test_too_many_failed_rollouts_fail_the_step_with_the_first_errors(hf_runtime):
    config = env_config(FailingFirst, args={"failures": 5})  # 5 of 8 rollouts
    with pytest.raises(RolloutError, match=r"step 2: env '.*:FailingFirst': 5 of 8 rollouts failed \(62%, more than "
                                           r"env.0.max_error_fraction = 0.5\); first errors:\n"
                                           r"  - ValueError: broken rollout 1\n  - ValueError: broken rollout 2\n"
                                           r"  - ValueError: broken rollout 3\n  \(2 more distinct errors\)"):
        run(config, hf_runtime, step=2)
    config.env[0].max_error_fraction = 0.0
    config.env[0].args = {"failures": 1}
    with pytest.raises(RolloutError, match="1 of 8 rollouts failed"):
        run(config, hf_runtime, step=2)


def test_failed_rollouts_up_to_the_limit_pass_with_their_error_fraction_as_a_metric(hf_runtime):
    traces, summary = run(env_config(FailingFirst, args={"failures": 4}), hf_runtime)  # 4 of 8: exactly 0.5
    name = f"{__name__}:FailingFirst"
    assert [t.error for t in traces].count(None) == 4
    assert summary.envs[name].error_fraction == 0.5 and summary.envs[name].errors == 4
    metrics = summary.metrics()
    assert metrics[f"rollouts/{name}/error_fraction"] == 0.5 and metrics[f"rollouts/{name}/traces"] == 8.0
    assert metrics[f"rollouts/{name}/reward_mean"] == 1.0
    _, clean = run(env_config(FailingFirst, args={"failures": 0}), hf_runtime)
    assert clean.metrics()[f"rollouts/{name}/error_fraction"] == 0.0
