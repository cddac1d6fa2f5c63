"""rloo, reinforce_pp, grpo's scale and DAPO's overlong shaping against hand-computed advantages."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.algorithms.helpers import chat_branch, make_trace, reward_trace, run
from trace_rl.algorithms import AlgorithmError, load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.config import Config
from trace_rl.runs.loading import check_algorithms


def advantages(spec, traces) -> dict[str, float]:
    """Each trace's advantage (the value on its last, sampled, token)."""
    return {c.trace_id: float(c.values[-1]) for c in run(apply_algorithm(load_algorithm(spec), traces))}


def long_trace(trace_id, reward, answer_tokens, group="g0"):
    """A user prompt (2 tokens) and a sampled answer of `answer_tokens` content tokens (+1 end token sampled)."""
    return make_trace(trace_id, [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "x"}],
                      [chat_branch([(0, 2, False), (1, answer_tokens, True)])], group=group, reward=reward)


def test_rloo_leaves_each_trace_out_of_its_baseline():
    traces = [reward_trace("a", 1.0), reward_trace("b", 0.0), reward_trace("c", 0.5),
              reward_trace("err", 9.0, error="timeout")]
    # a: 1 - (0 + 0.5)/2 = 0.75; b: 0 - 0.75 = -0.75; c: 0.5 - 0.5 = 0 (the errored trace is not in the group)
    assert advantages("rloo", traces) == pytest.approx({"a": 0.75, "b": -0.75, "c": 0.0})
    assert advantages("rloo", [reward_trace("alone", 3.0)]) == {"alone": 0.0}


def test_grpo_scale_none_group_and_the_old_std_normalize():
    traces = [reward_trace("a", 1.0), reward_trace("b", 0.0), reward_trace("c", 2.0)]
    std = 1.0  # unbiased: sqrt(((1-1)^2 + (0-1)^2 + (2-1)^2) / (3 - 1))
    group = {"a": 0.0, "b": -1 / (std + 1e-6), "c": 1 / (std + 1e-6)}
    assert advantages({"id": "grpo", "scale": "group"}, traces) == pytest.approx(group)
    assert advantages({"id": "grpo", "std_normalize": True}, traces) == advantages({"id": "grpo", "scale": "group"},
                                                                                    traces)
    assert advantages({"id": "grpo", "scale": "none"}, traces) == {"a": 0.0, "b": -1.0, "c": 1.0}
    assert advantages("grpo", traces) == advantages({"id": "grpo", "std_normalize": False}, traces)
    with pytest.raises(AlgorithmError, match="std_normalize is the older spelling of scale"):
        load_algorithm({"id": "grpo", "std_normalize": True, "scale": "group"})


def step_traces():
    # group g1: rewards 1, 0 (mean 0.5); group g2: rewards 4, 2, 0 (mean 2); all 5 rewards: std sqrt(2.24)
    return [reward_trace("a", 1.0, group="g1"), reward_trace("b", 0.0, group="g1"),
            reward_trace("c", 4.0, group="g2"), reward_trace("d", 2.0, group="g2"), reward_trace("e", 0.0, group="g2")]


def test_grpo_divides_by_torchs_unbiased_std_as_trl_and_verl_and_by_the_population_std_on_request():
    """TRL (`scale_rewards`) and verl (`compute_grpo_outcome_advantage`) take torch.std, whose default is unbiased."""
    import torch

    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # a group of 8
    traces = [reward_trace(f"t{i}", r) for i, r in enumerate(rewards)]
    tensor = torch.tensor(rewards, dtype=torch.float64)
    peers = ((tensor - tensor.mean()) / (tensor.std() + 1e-6)).tolist()
    got = advantages({"id": "grpo", "scale": "group"}, traces)
    assert [got[f"t{i}"] for i in range(8)] == pytest.approx(peers, rel=1e-6)
    population = advantages({"id": "grpo", "scale": "group", "std": "population"}, traces)
    assert population["t0"] / got["t0"] == pytest.approx(np.sqrt(8 / 7), rel=1e-5)  # 1.069x theirs
    assert advantages({"id": "grpo", "scale": "group"}, [reward_trace("alone", 0.7)]) == {"alone": 0.0}


def test_grpo_batch_scale_divides_by_the_std_of_the_whole_step():
    std = np.std([1.0, 0.0, 4.0, 2.0, 0.0], ddof=1)
    assert std == pytest.approx(np.sqrt(2.8))
    expected = {"a": 0.5 / (std + 1e-6), "b": -0.5 / (std + 1e-6), "c": 2 / (std + 1e-6), "d": 0.0,
                "e": -2 / (std + 1e-6)}
    assert advantages({"id": "grpo", "scale": "batch"}, step_traces()) == pytest.approx(expected)


def test_reinforce_pp_whitens_the_group_centred_rewards_over_the_steps_tokens():
    # centred: a 0.5, b -0.5 (3 sampled tokens each), c 2, d 0, e -2 (c has 5 sampled tokens, the others 3)
    traces = step_traces()
    traces[2] = long_trace("c", 4.0, 4, group="g2")
    x = np.array([0.5, -0.5, 2.0, 0.0, -2.0])
    n = np.array([3, 3, 5, 3, 3])
    mean = (n * x).sum() / n.sum()                      # = (1.5 - 1.5 + 10 + 0 - 6) / 17 = 4/17
    var = (n * (x - mean) ** 2).sum() / (n.sum() - 1)   # unbiased, over the 17 tokens
    expected = dict(zip("abcde", (x - mean) / np.sqrt(var + 1e-8)))
    got = advantages("reinforce_pp", traces)
    assert got == pytest.approx(expected)
    tokens = np.repeat([got[k] for k in "abcde"], n)
    assert tokens.mean() == pytest.approx(0.0, abs=1e-7) and tokens.std(ddof=1) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("spec", [{"id": "grpo", "scale": "batch"}, "reinforce_pp"])
def test_whole_step_results_do_not_depend_on_how_the_groups_come(spec):
    traces = step_traces() + [reward_trace(f"z{i}", float(i % 3), group=f"g{3 + i // 4}") for i in range(8)]
    expected = advantages(spec, traces)
    shuffled = traces[:]
    random.Random(0).shuffle(shuffled)
    assert advantages(spec, shuffled) == pytest.approx(expected, abs=1e-12)
    assert load_algorithm(spec).whole_step and not load_algorithm("grpo").whole_step


def test_dapo_overlong_shaping():
    # sampled tokens L = answer + end token: 4, 7, 9 with max_tokens 8, buffer 4: penalties 0, -(7-4)/4, -1
    traces = [long_trace("short", 1.0, 3), long_trace("mid", 1.0, 6), long_trace("over", 1.0, 8)]
    overlong = {"max_tokens": 8, "buffer": 4, "factor": 0.5}
    assert advantages({"id": "rl", "overlong": overlong}, traces) == pytest.approx(
        {"short": 1.0, "mid": 1.0 - 0.5 * 0.75, "over": 1.0 - 0.5})
    # grpo centres the shaped rewards: 1, 0.625, 0.5 -> mean 0.708333
    shaped = np.array([1.0, 0.625, 0.5])
    assert advantages({"id": "grpo", "overlong": overlong}, traces) == pytest.approx(
        dict(zip(["short", "mid", "over"], shaped - shaped.mean())))
    with pytest.raises(AlgorithmError, match="buffer = 9 exceeds overlong.max_tokens = 8"):
        load_algorithm({"id": "rloo", "overlong": {"max_tokens": 8, "buffer": 9}})
    with pytest.raises(AlgorithmError, match="overlong"):
        load_algorithm({"id": "max_rl", "overlong": overlong})  # rewards must stay >= 0 there: no option


@pytest.mark.parametrize("algorithm", ["rloo", "reinforce_pp"])
def test_group_baselines_refuse_a_group_of_one(algorithm):
    config = Config(name="r", env=[{"id": "reverse-text", "group_size": 1}], algorithms=[algorithm])
    assert any("env.0.group_size = 1" in p for p in check_algorithms(config))
