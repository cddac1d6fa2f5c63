import numpy as np
import pytest

from trace_rl.algorithms import AlgorithmError, load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.data.trace import Branch

from tests.algorithms.helpers import make_trace, reward_trace, run

SAMPLED = np.array([0, 0, 0, 0, 0, 1, 1, 1], bool)


def channels_by_trace(algorithm, traces):
    return {c.trace_id: c for c in run(apply_algorithm(load_algorithm(algorithm), traces))}


def test_grpo_centres_on_the_mean_of_ok_traces_only():
    traces = [reward_trace("a", 1.0), reward_trace("b", 0.0), reward_trace("c", 0.5),
              reward_trace("errored", 5.0, error="timeout"), reward_trace("judge", -3.0, trainable=False)]
    channels = channels_by_trace("grpo", traces)
    # mean over a, b, c = 0.5; the errored (5.0) and untrainable (-3.0) rewards do not shift it
    assert set(channels) == {"a", "b", "c"}
    for trace_id, advantage in {"a": 0.5, "b": -0.5, "c": 0.0}.items():
        np.testing.assert_array_equal(channels[trace_id].mask, SAMPLED)
        np.testing.assert_allclose(channels[trace_id].values, np.where(SAMPLED, advantage, 0.0))
        assert channels[trace_id].loss == "rl" and channels[trace_id].values.dtype == np.float32


def test_grpo_std_normalize_divides_by_group_std():
    channels = channels_by_trace({"id": "grpo", "std_normalize": True},
                                 [reward_trace("a", 1.0), reward_trace("b", 0.0), reward_trace("c", 2.0)])
    # mean 1, unbiased std 1
    std = 1.0
    assert channels["a"].values[5] == pytest.approx(0.0)
    assert channels["b"].values[5] == pytest.approx(-1 / (std + 1e-6))
    assert channels["c"].values[7] == pytest.approx(1 / (std + 1e-6))


@pytest.mark.parametrize("spec", ["grpo", {"id": "grpo", "std_normalize": True}, "max_rl"])
def test_a_group_of_one_gets_zero_but_is_still_masked(spec):
    channel = channels_by_trace(spec, [reward_trace("alone", 0.7)])["alone"]
    np.testing.assert_array_equal(channel.values, np.zeros(8))
    np.testing.assert_array_equal(channel.mask, SAMPLED)


def test_groups_are_separate():
    traces = [reward_trace("a", 1.0, group="g1"), reward_trace("b", 0.0, group="g1"),
              reward_trace("c", 10.0, group="g2"), reward_trace("d", 20.0, group="g2")]
    values = {k: c.values[5] for k, c in channels_by_trace("grpo", traces).items()}
    assert values == {"a": 0.5, "b": -0.5, "c": -5.0, "d": 5.0}


@pytest.mark.parametrize("spec", ["grpo", {"id": "grpo", "scale": "batch"}, "rloo", "max_rl"])
def test_each_seat_of_a_two_seat_game_has_its_own_baseline(spec):
    # number-debate's judge: one group of 3 games, player_a won twice and tied once. Pooled, every game's payoffs
    # average 0.5 and each advantage would be the payoff minus 0.5; per seat, a's mean is 5/6 and b's 1/6
    payoffs = [(1.0, 0.0), (1.0, 0.0), (0.5, 0.5)]
    traces = [reward_trace(f"r{game}-{seat}", payoff[index], agent=seat)
              for game, payoff in enumerate(payoffs) for index, seat in enumerate(("player_a", "player_b"))]
    values = {k: float(c.values[5]) for k, c in channels_by_trace(spec, traces).items()}
    expected = {  # by hand, per seat: grpo r - mean; rloo r - mean of the others; max_rl (r - mean) / mean
        "grpo": {"a": (1 / 6, 1 / 6, -1 / 3), "b": (-1 / 6, -1 / 6, 1 / 3)},
        "rloo": {"a": (0.25, 0.25, -0.5), "b": (-0.25, -0.25, 0.5)},
        "max_rl": {"a": (0.2, 0.2, -0.4), "b": (-1.0, -1.0, 2.0)},
    }
    if isinstance(spec, dict):  # divided by the step's std + 1e-6: rewards 1, 0, 1, 0, .5, .5, unbiased std 0.4472
        std = np.std([1, 0, 1, 0, 0.5, 0.5], ddof=1)
        expected["batch"] = {seat: tuple(v / (std + 1e-6) for v in by_seat)
                             for seat, by_seat in expected["grpo"].items()}
    for seat, advantages in expected["batch" if isinstance(spec, dict) else spec].items():
        got = [values[f"r{game}-player_{seat}"] for game in range(3)]
        np.testing.assert_allclose(got, advantages, rtol=1e-6, atol=1e-7)


def test_max_rl_normalizes_by_the_mean():
    traces = [reward_trace("a", 1.0), reward_trace("b", 0.0), reward_trace("c", 0.5), reward_trace("e", 9, error="x")]
    channels = channels_by_trace("max_rl", traces)
    # mu = 0.5: (1 - .5)/.5 = 1, (0 - .5)/.5 = -1, 0
    assert {k: float(c.values[6]) for k, c in channels.items()} == {"a": 1.0, "b": -1.0, "c": 0.0}


def test_max_rl_gives_zero_when_the_mean_is_zero():
    channels = channels_by_trace("max_rl", [reward_trace("a", 0.0), reward_trace("b", 0.0)])
    assert all(not c.values.any() and c.mask.sum() == 3 for c in channels.values())


def test_max_rl_rejects_negative_rewards_naming_the_trace():
    with pytest.raises(AlgorithmError, match=r"max_rl needs non-negative rewards.*'neg'.*-0\.5"):
        channels_by_trace("max_rl", [reward_trace("ok", 1.0), reward_trace("neg", -0.5)])


def test_rl_is_plain_reinforce():
    channels = channels_by_trace("rl", [reward_trace("a", 0.25), reward_trace("b", -2.0),
                                        reward_trace("frozen", 1.0, trainable=False)])
    assert {k: float(c.values[5]) for k, c in channels.items()} == {"a": 0.25, "b": -2.0}
    np.testing.assert_array_equal(channels["b"].values, np.where(SAMPLED, -2.0, 0.0))


@pytest.mark.parametrize("spec", ["grpo", "max_rl", "rl", "rae", "sft"])
def test_token_zero_is_never_trained_even_when_sampled(spec):
    # a continuation branch whose very first token was sampled
    branch = Branch(token_ids=[5, 6, 7], sampled=[1, 1, 0], logprobs=[-1, -1, 0], message_index=[0, 0, -1],
                    is_content=[1, 1, 0])
    traces = [make_trace(t, [{"role": "assistant", "content": "x"}], [Branch(**{
        k: getattr(branch, k) for k in ("token_ids", "sampled", "logprobs", "message_index", "is_content")})],
        reward=r) for t, r in (("a", 1.0), ("b", 3.0))]
    for channel in run(apply_algorithm(load_algorithm(spec), traces)):
        np.testing.assert_array_equal(channel.mask, [False, True, False])


@pytest.mark.parametrize("spec", ["grpo", "max_rl", "rl", "rae", "sft"])
def test_no_builtin_signals_untrainable_or_errored_traces(spec):
    traces = [reward_trace("judge", 1.0, trainable=False), reward_trace("broken", 1.0, error="env crashed")]
    assert run(apply_algorithm(load_algorithm(spec), traces)) == []


def test_unknown_option_is_named():
    with pytest.raises(AlgorithmError, match="std_norm: unknown key.*std_normalize"):
        load_algorithm({"id": "grpo", "std_norm": True})
