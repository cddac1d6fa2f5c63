import numpy as np
import pytest

from tests.algorithms.helpers import reward_trace
from trace_rl.data.channel import Channel
from trace_rl.pipeline.channels import sum_channels, channel_stats
from trace_rl.storage import RunStorage
from trace_rl.tables import read_batch, read_channels, write_batch, write_channels


def at(positions, values, n=8):
    out = np.zeros(n, np.float32)
    out[positions] = values
    return out


def mask_at(positions, n=8):
    return np.isin(np.arange(n), positions)


def example():
    traces = [reward_trace(t, 1.0) for t in "abcd"]
    traces[0].branches[0].temperature = 0.7
    channels = [
        Channel("grpo", "rl", "a", 0, at([5, 6, 7], 0.5), mask_at([5, 6, 7])),
        # opd's value at token 7 lies outside its mask and must not leak into the sum
        Channel("opd", "rl", "a", 0, at([5, 6, 7], [-0.2, 0.3, 9.0]), mask_at([5, 6])),
        Channel("echo", "ce", "a", 0, at([2], 0.1), mask_at([2])),
        Channel("grpo", "rl", "b", 0, np.zeros(8, np.float32), np.zeros(8, bool)),
        Channel("echo", "ce", "c", 0, at([2, 3], [0.0, 0.1]), mask_at([2, 3])),
    ]
    return traces, channels


def test_same_loss_channels_sum_inside_their_masks_and_masks_or():
    traces, channels = example()
    samples = sum_channels(traces, channels)
    # b masks nothing and d has no channel: no samples for them
    assert [(s.trace_id, s.branch_index, s.env) for s in samples] == [("a", 0, "toy"), ("c", 0, "toy")]
    a, c = samples
    np.testing.assert_allclose(a.rl_values, [0, 0, 0, 0, 0, 0.3, 0.8, 0.5], rtol=1e-6)
    np.testing.assert_array_equal(a.rl_mask, mask_at([5, 6, 7]))
    np.testing.assert_allclose(a.ce_values, at([2], 0.1))
    np.testing.assert_array_equal(a.ce_mask, mask_at([2]))
    assert a.temperature == pytest.approx(0.7)
    np.testing.assert_array_equal(a.input_ids, traces[0].branches[0].token_ids)
    np.testing.assert_array_equal(a.inference_logprobs, traces[0].branches[0].logprobs)
    # which tokens the sampler produced (at 0.7) and which it did not (the echo token 2: trained at temperature 1)
    np.testing.assert_array_equal(a.sampled, traces[0].branches[0].sampled)
    assert a.sampled.any() and not a.sampled[2]
    # a loss nobody produced is all zero / False
    assert c.rl_values.dtype == np.float32 and not c.rl_values.any() and not c.rl_mask.any()
    np.testing.assert_array_equal(c.ce_mask, mask_at([2, 3]))


def test_aggregation_does_not_touch_the_channels():
    traces, channels = example()
    before = [c.values.copy() for c in channels]
    sum_channels(traces, channels)
    for channel, values in zip(channels, before):
        np.testing.assert_array_equal(channel.values, values)


def test_samples_map_onto_batch_parquet(tmp_path):
    traces, channels = example()
    storage = RunStorage(str(tmp_path), "run")
    samples = sum_channels(traces, channels)
    write_batch(storage, 3, samples)
    again = read_batch(storage, 3)
    assert [s.trace_id for s in again] == ["a", "c"]
    np.testing.assert_allclose(again[0].rl_values, samples[0].rl_values)
    np.testing.assert_array_equal(again[0].ce_mask, samples[0].ce_mask)
    np.testing.assert_array_equal(again[0].sampled, samples[0].sampled)


def test_channels_round_trip_through_parquet(tmp_path):
    _, channels = example()
    storage = RunStorage(str(tmp_path), "run")
    path = write_channels(storage, storage.step_path(1, "channels.parquet"), channels)
    again = read_channels(storage, path)
    assert [(c.algorithm_id, c.loss, c.trace_id, c.branch_index) for c in again] == [
        (c.algorithm_id, c.loss, c.trace_id, c.branch_index) for c in channels]
    for mine, theirs in zip(channels, again):
        assert theirs.values.dtype == np.float32 and theirs.mask.dtype == np.bool_
        np.testing.assert_array_equal(mine.values, theirs.values)
        np.testing.assert_array_equal(mine.mask, theirs.mask)


def test_channel_stats_per_algorithm():
    _, channels = example()
    channels.append(Channel("grpo", "rl", "c", 0, at([5], -1.0), mask_at([5])))
    stats = channel_stats(channels)
    # grpo: a (3 x 0.5), b (nothing), c (-1.0) -> 4 tokens, mean 0.125
    assert stats["channel/grpo/branches"] == 3
    assert stats["channel/grpo/tokens"] == 4
    assert stats["channel/grpo/mean"] == pytest.approx(0.125)
    assert (stats["channel/grpo/min"], stats["channel/grpo/max"]) == (-1.0, 0.5)
    assert stats["channel/opd/tokens"] == 2 and stats["channel/opd/mean"] == pytest.approx(0.05)
    assert stats["channel/echo/tokens"] == 3 and stats["channel/echo/max"] == pytest.approx(0.1)
    only_empty = channel_stats([Channel("grpo", "rl", "b", 0, np.zeros(8, np.float32), np.zeros(8, bool))])
    assert only_empty == {"channel/grpo/branches": 1.0, "channel/grpo/tokens": 0.0, "channel/grpo/mean": 0.0,
                          "channel/grpo/min": 0.0, "channel/grpo/max": 0.0}
