"""The rollout loop: groups, ids, seeds, per-env temperature, retries with backoff, error traces."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from tests.envs.conftest import FailingRuntime
from trace_rl.config import Config
from trace_rl.errors import RetryableError
from trace_rl.rollouts import sample_rollouts
from trace_rl.trace import group_traces


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
    return asyncio.run(sample_rollouts(config, {"policy": runtime}, step))


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
    assert {t.policy_version for t in traces} == {runtime.policy_version}
    assert all(t.error is None for t in traces) and summary.retries == 0 and summary.errors == []
    rewards = np.array([t.reward for t in reverse])
    assert summary.envs["reverse-text"].reward_mean == pytest.approx(rewards.mean())
    assert summary.envs["reverse-text"].reward_std == pytest.approx(rewards.std())
    assert summary.metrics()["rollouts/number-debate/traces"] == 4.0


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
    slow = FailingRuntime(hf_runtime, delay_s=1.0)
    traces, summary = run(config, slow)
    assert slow.calls == 4  # two rollouts, two attempts each
    assert all(t.error == "gave up after 2 attempts: RetryableError: sampler timed out after 0.05s" for t in traces)
    assert summary.envs["reverse-text"].failed_groups == [traces[0].group_id]


def test_other_errors_mark_traces_and_failed_groups_are_reported(hf_runtime, caplog):
    config = make_config()
    broken = FailingRuntime(hf_runtime, ValueError("bad prompt"))
    with caplog.at_level(logging.WARNING, logger="trace_rl.rollouts"):
        traces, summary = run(config, broken)
    assert broken.calls == 2 * 2 + 2  # no retries: one call per rollout
    assert len(traces) == 6 and all(t.error == "ValueError: bad prompt" and not t.ok for t in traces)
    assert all(t.branches == [] and t.group_id and t.id for t in traces)
    assert summary.errors == ["ValueError: bad prompt"]
    failed = summary.envs["reverse-text"].failed_groups + summary.envs["number-debate"].failed_groups
    assert failed == list(group_traces(traces)) and len(failed) == 3
    assert sum("every rollout of group" in r.message for r in caplog.records) == 3
    assert summary.metrics()["rollouts/reverse-text/failed_groups"] == 2.0
