import numpy as np
import pytest

from tests.algorithms.helpers import reward_trace
from trace_rl.data.channel import Channel
from trace_rl.data.validate import DimensionError, validate_channels

# reward_trace: 8 tokens, sampled at 5, 6, 7


def channel(loss="rl", values=None, mask=None, trace_id="a", branch_index=0, algorithm_id="algo"):
    mask = np.array([0, 0, 0, 0, 0, 1, 1, 1], bool) if mask is None else np.asarray(mask, bool)
    values = np.where(mask, 0.5, 0).astype(np.float32) if values is None else np.asarray(values, float)
    return Channel(algorithm_id, loss, trace_id, branch_index, values, mask)


WHERE = r"env 'toy' trace 'a' branch 0 algorithm 'algo': "


def test_valid_channels_pass():
    validate_channels([reward_trace("a", 1.0)], [channel(), channel("ce", mask=[0, 1, 1, 1, 0, 0, 0, 0])])


@pytest.mark.parametrize("bad, what", [
    (dict(values=np.zeros(7)), r"values has shape \(7,\) but the branch has 8 tokens"),
    (dict(values=np.zeros(8), mask=np.zeros(9)), r"mask has shape \(9,\) but the branch has 8 tokens"),
    (dict(values=[0, 0, 0, 0, 0, np.nan, 0, 0]), r"value at token 5 is nan \(nan in float32\); values must be finite"),
    (dict(values=[0, 0, 0, 0, 0, 0, 0, np.inf]), "value at token 7 is inf"),
    (dict(values=[0, 0, 0, 0, 0, 0, 1e39, 0]), r"value at token 6 is 1e\+39 \(inf in float32\)"),
    (dict(loss="ce", mask=[1, 1, 0, 0, 0, 0, 0, 0]), "mask is true at token 0, which has no logprob"),
    (dict(mask=[0, 0, 1, 0, 0, 1, 0, 0]), "rl mask covers token 2, which the actor did not sample"),
    (dict(loss="kl"), r"loss 'kl' is unknown to the trainer \(known: rl, ce\)"),
])
def test_each_rule_names_env_trace_branch_algorithm_and_problem(bad, what):
    with pytest.raises(DimensionError, match=WHERE + what):
        validate_channels([reward_trace("a", 1.0)], [channel("ce", values=np.zeros(8), mask=np.zeros(8)),
                                                     channel(**bad)])


def test_rl_on_an_untrainable_trace_is_rejected_but_ce_is_not():
    traces = [reward_trace("a", 1.0, trainable=False)]
    with pytest.raises(DimensionError, match=WHERE + r"rl channel masks tokens of an untrainable trace"):
        validate_channels(traces, [channel("rl")])
    validate_channels(traces, [channel("ce")])


def test_no_channel_may_mask_an_untrainable_branch():
    traces = [reward_trace("a", 1.0)]
    traces[0].branches[0].trainable = False
    for loss in ("rl", "ce"):
        with pytest.raises(DimensionError, match=WHERE + r"channel masks tokens of an untrainable branch"):
            validate_channels(traces, [channel(loss)])
    validate_channels(traces, [channel("ce", values=np.zeros(8), mask=np.zeros(8))])  # masking nothing is fine


def test_mask_and_values_dtypes_are_checked():
    bad = channel()
    bad.mask = bad.mask.astype(np.int8)
    with pytest.raises(DimensionError, match=WHERE + "mask has dtype int8; expected bool"):
        validate_channels([reward_trace("a", 1.0)], [bad])


def test_unknown_trace_or_branch():
    with pytest.raises(DimensionError, match=r"env '\?' trace 'zz' branch 0 algorithm 'algo': no such trace"):
        validate_channels([reward_trace("a", 1.0)], [channel(trace_id="zz")])
    with pytest.raises(DimensionError, match="trace 'a' branch 3 algorithm 'algo': the trace has no such branch"):
        validate_channels([reward_trace("a", 1.0)], [channel(branch_index=3)])


def test_source_names_where_remote_channels_came_from():
    with pytest.raises(DimensionError, match=r"^http://127.0.0.1:9000: " + WHERE + "values has shape"):
        validate_channels([reward_trace("a", 1.0)], [channel(values=np.zeros(3))], source="http://127.0.0.1:9000")


def test_non_finite_advantages_from_a_real_algorithm_are_rejected_naming_env_trace_branch_and_algorithm():
    from tests.algorithms.helpers import run
    from trace_rl.algorithms.base import Algorithm, AlgorithmConfig
    from trace_rl.algorithms.runner import apply_algorithm

    class Normalized(Algorithm):
        """(reward - mean) / std without an epsilon: NaN for a group whose rewards are all equal."""

        loss = "rl"

        async def advantage(self, traces):
            rewards = np.array([t.reward for t in traces], np.float32)
            with np.errstate(invalid="ignore", divide="ignore"):
                scores = (rewards - rewards.mean()) / rewards.std()
            for trace, score in zip(traces, scores):
                branch = trace.branches[0]
                branch.mask = branch.sampled.copy()
                branch.advantages = np.where(branch.mask, score, 0).astype(np.float32)

    traces = [reward_trace("a", 1.0), reward_trace("b", 0.0), reward_trace("c", 1.0, group="g1"),
              reward_trace("d", 1.0, group="g1")]
    algorithm = Normalized(AlgorithmConfig(id="normalized"))
    channels = run(apply_algorithm(algorithm, traces))
    assert [c.trace_id for c in channels] == ["a", "b", "c", "d"]
    assert np.isfinite(channels[0].values).all() and np.isnan(channels[2].values[5])
    with pytest.raises(DimensionError, match=r"env 'toy' trace 'c' branch 0 algorithm 'normalized': value at token 5 "
                                             r"is nan \(nan in float32\); values must be finite in float32"):
        validate_channels(traces, channels)
