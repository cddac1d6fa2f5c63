"""The `[async]` schedule: which weights sample which step, and the staleness guard."""

import pytest

from tests.data.test_trace import make_trace
from trace_rl.config import ConfigError, parse_config
from trace_rl.pipeline.schedule import (
    StaleTraceError,
    check_staleness,
    lag_metrics,
    sampled_while_training,
    sampling_weights,
)


def test_k0_is_the_synchronous_schedule():
    assert [sampling_weights(n, 0) for n in range(1, 6)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("k", "expected"), [(1, [0, 0, 1, 2, 3]), (2, [0, 0, 0, 1, 2])])
def test_step_n_samples_with_the_weights_of_step_n_minus_1_minus_k(k, expected):
    assert [sampling_weights(n, k) for n in range(1, 6)] == expected


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_what_is_sampled_while_a_step_trains_has_its_weights_saved_already(k):
    steps, sampled_upto, seen = 6, 1, [1]
    for step in range(1, steps + 1):
        ahead = sampled_while_training(step, k, sampled_upto, steps)
        assert all(sampling_weights(m, k) <= step - 1 for m in ahead)  # weights of steps < step exist
        assert all(m <= step + k for m in ahead)
        seen += ahead
        sampled_upto = max(seen)
    assert seen == list(range(1, steps + 1))  # every step sampled once, in order


def test_k1_samples_the_next_step_while_one_trains():
    assert [sampled_while_training(n, 1, n, 4) for n in (1, 2, 3, 4)] == [[2], [3], [4], []]
    assert sampled_while_training(1, 2, 1, 5) == [2, 3]
    assert sampled_while_training(2, 2, 3, 5) == [4]


def test_a_trace_older_than_k_versions_is_refused():
    traces = [make_trace("fresh", policy_step=3), make_trace("stale", policy_step=1)]
    check_staleness(traces, step=5, max_off_policy_steps=3)  # v(5) = 1: both allowed
    with pytest.raises(StaleTraceError, match=r"step 5: 1 trace\(s\) \(first 'stale'\).*weights of step 1"):
        check_staleness(traces, step=5, max_off_policy_steps=1)
    with pytest.raises(StaleTraceError):
        check_staleness(traces, step=4, max_off_policy_steps=0)


def test_lag_metrics_measure_the_distance_to_the_synchronous_schedule():
    traces = [make_trace("a", policy_step=2), make_trace("b", policy_step=3)]
    assert lag_metrics(traces, step=5) == {"async/policy_step": 2.0, "async/policy_lag_mean": 1.5,
                                           "async/policy_lag_max": 2.0}


def test_async_is_a_toml_table_with_a_checked_key():
    config = parse_config({"name": "x", "env": [{"id": "reverse-text"}], "async": {"max_off_policy_steps": 2}})
    assert config.async_.max_off_policy_steps == 2
    assert config.model_dump(mode="json")["async"] == {"max_off_policy_steps": 2, "partial_rollout_tokens": None,
                                                       "max_token_age": None, "stale_tokens": "mask"}
    with pytest.raises(ConfigError, match="async.max_off_policy_steps: Input should be greater than or equal to 0"):
        parse_config({"name": "x", "env": [{"id": "reverse-text"}], "async": {"max_off_policy_steps": -1}})
    with pytest.raises(ConfigError, match="async.max_off_policy_step: unknown key; did you mean "
                                          "'max_off_policy_steps'"):
        parse_config({"name": "x", "env": [{"id": "reverse-text"}], "async": {"max_off_policy_step": 1}})
