import json

import numpy as np
import pytest

from trace_rl.algorithms import AlgorithmError, load_algorithm
from trace_rl.algorithms.runner import apply_algorithm

from tests.algorithms.helpers import reward_trace, run


def advantages(algorithm, traces):
    return [float(c.values[5]) for c in run(apply_algorithm(algorithm, traces))]


def test_baseline_per_agent_moves_after_each_advantage():
    rae = load_algorithm({"id": "rae", "decay": 0.5})
    # agent "x": A = 1 - 0 = 1, b = .5; A = 0 - .5 = -.5, b = .25 | agent "y": A = 4 - 0 = 4, b = 2
    traces = [reward_trace("x1", 1.0, agent="x"), reward_trace("y1", 4.0, agent="y"),
              reward_trace("x2", 0.0, agent="x")]
    assert advantages(rae, traces) == [1.0, 4.0, -0.5]
    assert rae.state_dict() == {"key": "agent", "baselines": {"x": 0.25, "y": 2.0}}
    # the next step starts from those baselines: A = 1 - .25
    assert advantages(rae, [reward_trace("x3", 1.0, agent="x", group="g2")]) == [0.75]


def test_default_decay_is_095_and_untrainable_traces_leave_the_baseline_alone():
    rae = load_algorithm("rae")
    traces = [reward_trace("a", 2.0), reward_trace("frozen", 100.0, trainable=False), reward_trace("b", 2.0)]
    # A = 2, b = .05 * 2 = .1; A = 2 - .1 = 1.9
    assert advantages(rae, traces) == pytest.approx([2.0, 1.9])
    assert rae.baselines == {"policy-agent": pytest.approx(0.195)}


def test_per_example_baselines():
    rae = load_algorithm({"id": "rae", "decay": 0.5, "key": "example"})
    first = reward_trace("a", 1.0)
    other = reward_trace("b", 1.0, group="g1")
    other.example_id = "e1"
    assert advantages(rae, [first, other]) == [1.0, 1.0]
    assert rae.state_dict()["baselines"] == {'["toy", "e0", "policy-agent"]': 0.5, '["toy", "e1", "policy-agent"]': 0.5}


def test_state_survives_save_and_load_through_json():
    rae = load_algorithm({"id": "rae", "decay": 0.5})
    advantages(rae, [reward_trace("a", 1.0), reward_trace("b", 3.0)])  # b: .5 then 1.75
    saved = json.loads(json.dumps(rae.state_dict()))
    resumed = load_algorithm({"id": "rae", "decay": 0.5})
    resumed.load_state_dict(saved)
    np.testing.assert_allclose(advantages(resumed, [reward_trace("c", 2.0)]), [0.25])
    # a fresh instance without the state would have given 2.0
    assert advantages(load_algorithm({"id": "rae", "decay": 0.5}), [reward_trace("c", 2.0)]) == [2.0]


def test_empty_state_starts_fresh():
    rae = load_algorithm({"id": "rae", "decay": 0.5})
    rae.load_state_dict({})
    assert advantages(rae, [reward_trace("a", 1.0)]) == [1.0]


def test_loading_state_of_another_key_mode_is_refused():
    rae = load_algorithm({"id": "rae", "key": "example"})
    with pytest.raises(AlgorithmError, match="per 'agent' but key = 'example'"):
        rae.load_state_dict({"key": "agent", "baselines": {"x": 1.0}})


def test_stateless_algorithms_refuse_state():
    with pytest.raises(AlgorithmError, match="keeps no state"):
        load_algorithm("grpo").load_state_dict({"baselines": {}})
