import numpy as np
import pytest

from trace_rl.algorithms import AlgorithmError, load_algorithm
from trace_rl.algorithms.runner import apply_algorithm, apply_algorithms, load_algorithms

from tests.algorithms.helpers import reward_trace, run


def test_third_party_algorithm_loads_from_an_import_path():
    traces = [reward_trace("a", 1.0)]
    [channel] = run(apply_algorithm(load_algorithm("tests.algorithms.plugins:LastTokenBonus"), traces))
    assert (channel.algorithm_id, channel.loss, channel.trace_id, channel.branch_index) == (
        "tests.algorithms.plugins:LastTokenBonus", "ce", "a", 0)
    assert channel.values.tolist() == [0.0] * 7 + [2.0]


def test_annotations_are_cleared_before_and_after_each_group():
    traces = [reward_trace("a", 1.0), reward_trace("b", 0.0, group="g1")]
    stale = traces[1].branches[0]
    stale.advantages, stale.mask = np.ones(8, np.float32), np.ones(8, bool)  # left over from somewhere else
    channels = run(apply_algorithm(load_algorithm("rl"), [traces[0]]))
    assert [c.trace_id for c in channels] == ["a"]
    # grpo gives b 0 (a group of one): its stale all-ones annotation was cleared before the run
    [channel_b] = [c for c in run(apply_algorithm(load_algorithm("grpo"), traces)) if c.trace_id == "b"]
    assert not channel_b.values.any() and not channel_b.mask[0]
    assert all(b.advantages is None and b.mask is None for t in traces for b in t.branches)


def test_setting_only_one_of_advantages_and_mask_is_an_error_naming_it():
    algorithm = load_algorithm("tests.algorithms.plugins:HalfAnnotated")
    traces = [reward_trace("a", 1.0)]
    with pytest.raises(AlgorithmError, match=r"'tests.algorithms.plugins:HalfAnnotated' set only one of "
                                             r"advantages/mask on trace 'a' branch 0: mask is None"):
        run(apply_algorithm(algorithm, traces))
    assert traces[0].branches[0].advantages is None  # cleared even on failure


def test_run_algorithms_keys_channels_by_position_and_restores_state():
    models = {}
    algorithms = run(load_algorithms(["grpo", {"id": "rae", "decay": 0.5}], models,
                                     states=[{}, {"key": "agent", "baselines": {"policy-agent": 1.0}}]))
    out = run(apply_algorithms(algorithms, [reward_trace("a", 1.0), reward_trace("b", 3.0)]))
    assert sorted(out) == [0, 1]
    assert [float(c.values[5]) for c in out[0]] == [-1.0, 1.0]
    assert [float(c.values[5]) for c in out[1]] == [0.0, 2.0]  # b: 3 - (.5 * 1 + .5 * 1)


def test_load_algorithms_checks_the_number_of_states():
    with pytest.raises(AlgorithmError, match="got 1 algorithm states for 2 algorithms"):
        run(load_algorithms(["grpo", "rl"], {}, states=[{}]))
