import numpy as np
import pytest

from trace_rl.data.trace import Branch, Message, Trace, TraceError, group_traces


def make_branch(index=0, n=5, sampled_from=3, temperature=1.0, trainable=True):
    sampled = np.arange(n) >= sampled_from
    return Branch(
        token_ids=np.arange(n) + 10,
        sampled=sampled,
        logprobs=np.where(sampled, -0.5, 0.0),
        message_index=np.where(sampled, 1, 0),
        is_content=np.ones(n, bool),
        index=index,
        temperature=temperature,
        trainable=trainable,
    )


def make_trace(trace_id="t0", group="g0", branches=None, **kw):
    return Trace(
        id=trace_id, env="reverse-text", example_id="e0", group_id=group,
        messages=[Message(role="user", content="abc"), Message(role="assistant", content="cba")],
        branches=branches if branches is not None else [make_branch()], **kw,
    )


def test_branch_arrays_get_their_dtypes():
    b = make_branch()
    assert (b.token_ids.dtype, b.sampled.dtype, b.logprobs.dtype) == (np.int32, np.bool_, np.float32)
    assert (b.message_index.dtype, b.is_content.dtype) == (np.int32, np.bool_)
    assert b.advantages is None and b.mask is None


def test_branch_arrays_of_different_length_are_rejected():
    with pytest.raises(TraceError, match="differ in length"):
        Branch(token_ids=[1, 2, 3], sampled=[0, 1], logprobs=[0, 0, 0], message_index=[0, 0, 0], is_content=[1, 1, 1])


def test_message_index_must_point_at_a_message():
    with pytest.raises(TraceError, match="out of range"):
        make_trace(branches=[Branch(token_ids=[1], sampled=[0], logprobs=[0], message_index=[5], is_content=[1])])


def test_branch_indices_follow_positions():
    with pytest.raises(TraceError, match="index 1"):
        make_trace(branches=[make_branch(index=1)])


def test_json_round_trip_is_exact_including_annotations():
    branch = make_branch(temperature=0.7)
    branch.advantages = np.array([0, 0, 0, 0.1, -1e-7], np.float32)
    branch.mask = np.array([0, 0, 0, 1, 1], bool)
    trace = make_trace(reward=0.25, rewards={"sim": 0.25}, metrics={"len": 3}, info={"answer": "cba"},
                       error=None, policy_step=4, branches=[branch, make_branch(index=1, trainable=False)])
    again = Trace.from_json(trace.to_json())
    assert again.equals(trace)
    assert [b.trainable for b in again.branches] == [True, False]
    assert again.branches[0].advantages.dtype == np.float32
    assert again.branches[1].advantages is None


def test_ok_excludes_untrainable_and_errored():
    assert make_trace().ok
    assert not make_trace(trainable=False).ok
    assert not make_trace(error="timeout").ok


def test_group_traces_keeps_first_seen_order():
    traces = [make_trace("a", "g1"), make_trace("b", "g0"), make_trace("c", "g1")]
    assert {k: [t.id for t in v] for k, v in group_traces(traces).items()} == {"g1": ["a", "c"], "g0": ["b"]}
