"""verifiers v1 traces <-> trace-rl traces, against traces built by verifiers' own graph code (`prepare_turn` and
`commit`, what a verifiers rollout runs per turn) and read back by `vf.WireTrace`."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

import verifiers.v1 as vf  # the test extra installs it: a missing package fails, never skips
from verifiers.v1.graph import prepare_turn  # noqa: E402

from trace_rl.algorithms.lookup import load_algorithm  # noqa: E402
from trace_rl.algorithms.runner import apply_algorithm  # noqa: E402
from trace_rl.data.trace import Branch, Message, Trace  # noqa: E402
from trace_rl.verifiers.convert import (  # noqa: E402
    ConversionError, record_from_trace, trace_from_vf, untokenized, vf_from_trace,
)

SYSTEM, USER = vf.SystemMessage(content="be brief"), vf.UserMessage(content="2+2?")
REPLY, FOLLOW_UP = vf.AssistantMessage(content="4"), vf.UserMessage(content="and 3+3?")
# turn 1: system (0..3) and user (3..7) spans, then the generation prompt 7..9
TURN1 = dict(prompt_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9], completion_ids=[20, 21], completion_logprobs=[-0.5, -0.25],
             message_spans=[(0, 3), (3, 7)], is_content=[False, True, False, False, True, True, False, False, False])


def new_trace(idx: int = 3, temperature: float | None = 0.7) -> vf.WireTrace:
    config = {} if temperature is None else {"sampling": {"temperature": temperature}}
    return vf.WireTrace(task={"type": "Arith", "data": {"idx": idx}}, agent={"config": config, "name": "solver"},
                        ok=True, is_completed=True)


def play(trace: vf.WireTrace, prompt: list, message: vf.AssistantMessage, **tokens) -> None:
    """One turn through verifiers' graph: prompt resolved against the trace, the response's tokens committed."""
    turn = prepare_turn(trace, prompt)
    turn.commit(vf.Response(id="r", created=0, model="m", message=message, finish_reason="stop",
                            tokens=vf.TurnTokens(**tokens)))


def two_turns(second_prompt_ids: list[int], spans: list) -> vf.WireTrace:
    trace = new_trace()
    play(trace, [SYSTEM, USER], REPLY, **TURN1)
    play(trace, [SYSTEM, USER, REPLY, FOLLOW_UP], vf.AssistantMessage(content="6"), prompt_ids=second_prompt_ids,
         completion_ids=[40], completion_logprobs=[-0.125], message_spans=spans)
    return trace


def arrays(branch: Branch) -> dict[str, list]:
    return {name: getattr(branch, name).tolist() for name in ("token_ids", "sampled", "logprobs", "message_index",
                                                                "is_content")}


def test_one_branch_single_turn_is_token_exact():
    trace = new_trace()
    play(trace, [SYSTEM, USER], REPLY, **TURN1)
    trace.record_reward("correct", 1.0, weight=0.5)
    trace.record_reward("short", 0.5, weight=2.0)
    trace.record_metric("length", 2)
    converted = trace_from_vf(trace)

    assert [m.model_dump(exclude_none=True) for m in converted.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]
    [branch] = converted.branches
    assert branch.token_ids.tolist() == trace.branches[0].token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21]
    assert arrays(branch) == {
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21],
        "sampled": [False] * 9 + [True, True],
        "logprobs": [0.0] * 9 + [-0.5, -0.25],
        "message_index": [0, 0, 0, 1, 1, 1, 1, -1, -1, 2, 2],  # the generation prompt belongs to no message
        "is_content": [False, True, False, False, True, True, False, False, False, True, True],
    }
    assert branch.temperature == pytest.approx(0.7) and branch.trainable
    assert converted.reward == 1.0 * 0.5 + 0.5 * 2.0 == trace.reward
    assert converted.rewards == {"correct": 1.0, "short": 0.5}  # the named components, unweighted
    assert converted.metrics == {"length": 2.0}
    assert (converted.env, converted.example_id, converted.group_id) == ("Arith", "3", "Arith/3")
    assert (converted.id, converted.agent, converted.trainable, converted.error) == (trace.id, "solver", True, None)


def test_multi_turn_spans_extend_one_branch():
    prompt = [*TURN1["prompt_ids"], 20, 21, 30, 31, 32, 33, 34]  # turn 1's exact ids, then the follow-up and prompt
    trace = two_turns(prompt, spans=[(0, 3), (3, 7), (7, 11), (11, 14)])
    [branch] = trace_from_vf(trace).branches

    assert len(trace.branches) == 1
    assert branch.token_ids.tolist() == [*prompt, 40]
    assert branch.message_index.tolist() == [0, 0, 0, 1, 1, 1, 1, -1, -1, 2, 2, 3, 3, 3, -1, -1, 4]
    assert branch.sampled.tolist() == [False] * 9 + [True, True] + [False] * 5 + [True]
    assert branch.logprobs[branch.sampled].tolist() == [-0.5, -0.25, -0.125]
    # turn 2 came without is_content: its nodes count their sampled tokens as content, turn 1's keep theirs
    assert branch.is_content.tolist() == TURN1["is_content"] + [True, True] + [False] * 5 + [True]


def test_a_re_rendered_history_gives_two_branches_sharing_their_messages():
    prompt = [1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 30, 31, 32, 33, 34]  # turn 1's reply re-tokenized as 50 51 52
    trace = two_turns(prompt, spans=[(0, 3), (3, 7), (7, 10), (10, 13)])
    converted = trace_from_vf(trace)

    assert len(trace.branches) == 2 and len(converted.branches) == 2
    first, second = converted.branches
    assert first.token_ids.tolist() == trace.branches[0].token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21]
    assert second.token_ids.tolist() == trace.branches[1].token_ids == [*prompt, 40]
    assert second.sampled.tolist() == [False] * 15 + [True]  # turn 1's reply is context in the second branch
    assert [m.content for m in converted.messages] == ["be brief", "2+2?", "4", "and 3+3?", "6"]
    # the system and user nodes are shared; the re-rendered reply is a node of its own, the same message 2
    assert second.message_index.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, -1, -1, 4]


def test_an_untrainable_branch_is_kept_and_never_trained():
    prompt = [1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 30, 31, 32, 33, 34]
    trace = two_turns(prompt, spans=[(0, 3), (3, 7), (7, 10), (10, 13)])
    # the first leaf as verifiers records an abandoned compaction attempt
    trace.nodes[2].semantic_parents.append(vf.ParentLink(node=1, type="compaction_attempt"))
    assert [b.trainable for b in trace.branches] == [False, True]
    converted = trace_from_vf(trace)
    assert [b.trainable for b in converted.branches] == [False, True]

    other = trace_from_vf(two_turns(prompt, spans=[(0, 3), (3, 7), (7, 10), (10, 13)]))
    other.id, other.reward = "other", 1.0
    channels = asyncio.run(apply_algorithm(load_algorithm("grpo"), [converted, other]))
    trained = {(c.trace_id, c.branch_index) for c in channels if c.mask.any()}
    assert (converted.id, 0) not in trained
    assert {(converted.id, 1), ("other", 0), ("other", 1)} <= trained


def test_a_failed_episode_is_a_failed_rollout():
    trace = new_trace()
    play(trace, [SYSTEM, USER], REPLY, **TURN1)
    trace.record_error(ValueError("the judge timed out"))
    trace.rewards["correct"] = None  # scoring did not run
    converted = trace_from_vf(trace)
    assert converted.error == "ValueError: the judge timed out"
    assert not converted.ok and converted.rewards == {} and converted.reward == 0.0
    assert len(converted.branches) == 1  # its tokens are kept; no builtin trains a trace that is not ok


def test_turns_sampled_through_an_eval_client_are_refused():
    trace = new_trace()
    turn = prepare_turn(trace, [SYSTEM, USER])
    turn.commit(vf.Response(id="r", created=0, model="m", message=REPLY, finish_reason="stop"))  # no tokens
    assert untokenized(trace)
    with pytest.raises(ConversionError, match=f"trace {trace.id}: a sampled turn has no token ids"):
        trace_from_vf(trace)


def test_a_branch_sampled_at_two_temperatures_is_refused():
    trace = two_turns([*TURN1["prompt_ids"], 20, 21, 30, 31, 32, 33, 34], spans=[(0, 3), (3, 7), (7, 11), (11, 14)])
    trace.calls = [vf.ModelCall(node=2, sampling={"temperature": 0.7}), vf.ModelCall(node=4, sampling={"temperature": 1.0})]
    with pytest.raises(ConversionError, match="branch 0: sampled at temperatures \\[0.7, 1.0\\]"):
        trace_from_vf(trace)


def read_back(trace: Trace) -> vf.WireTrace:
    """The trace as a JSON record line and back through verifiers' record loader."""
    return vf.WireTrace.model_validate(json.loads(json.dumps(record_from_trace(trace, model="tiny", step=4))))


@pytest.mark.parametrize("case", ["one branch", "re-rendered", "untrainable", "failed"])
def test_trace_rl_traces_round_trip_through_verifiers_records(case):
    rng = np.random.default_rng(0)
    if case == "failed":
        original = Trace(id="t-failed", env="reverse_text", example_id="1f-2", group_id="step4-reverse_text-1f-2",
                         messages=[{"role": "user", "content": "abc"}], error="gave up after 3 attempts: boom")
    else:
        prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
        branches = [Branch(token_ids=prompt + [20, 21, 22], sampled=[False] * 9 + [True] * 3,
                           logprobs=[0.0] * 9 + rng.normal(size=3).astype(np.float32).tolist(),
                           message_index=[0, 0, 0, 0, 1, 1, 1, -1, -1, 2, 2, 2],
                           is_content=[False, True, True, False, False, True, False, False, False, True, True, False],
                           temperature=0.9)]
        if case != "one branch":
            branches.append(Branch(index=1, token_ids=[1, 2, 3, 4, 5, 6, 7, 60, 61, 62, 63, 8, 9, 70],
                                   sampled=[False] * 13 + [True], logprobs=[0.0] * 13 + [-1.2345678],
                                   message_index=[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, -1, 4],
                                   is_content=[False] * 8 + [True] * 6, temperature=0.9,
                                   trainable=case != "untrainable"))
        if case == "untrainable":
            branches[0], branches[1] = (Branch(**{**vars(branches[0]), "trainable": False}),
                                        Branch(**{**vars(branches[1]), "trainable": True}))
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "cba",
                     "tool_calls": [{"id": "c1", "name": "look", "arguments": {"q": 1}}]},
                    {"role": "tool", "content": "found", "name": "look", "tool_call_id": "c1"},
                    {"role": "assistant", "content": "x"}]
        original = Trace(id="t1", env="reverse_text", example_id="12", group_id="step4-reverse_text-12",
                         branches=branches, messages=messages[: 3 if case == "one branch" else 5],
                         agent="policy-agent", reward=0.75, rewards={"similarity": 0.5, "length": 0.5},
                         metrics={"turns": 2.0}, info={"answer": "cba"}, policy_step=3)
    record = read_back(original)
    tokenized = [branch for branch in record.branches if branch.token_ids]  # a failed trace: its messages, no tokens
    assert len(tokenized) == len(original.branches)
    for theirs, ours in zip(tokenized, original.branches):
        assert theirs.token_ids == ours.token_ids.tolist()
        assert theirs.sampled_mask == ours.sampled.tolist()
        assert np.array_equal(np.asarray(theirs.logprobs, np.float32), ours.logprobs)
        assert theirs.trainable == ours.trainable
    assert record.reward == original.reward and record.ok == original.ok
    back = trace_from_vf(record)
    assert back.equals(original), (back.to_dict(), original.to_dict())


def test_a_message_in_two_pieces_is_refused():
    branch = Branch(token_ids=[1, 2, 3, 4], sampled=[False, False, True, True], logprobs=[0, 0, -1, -1],
                    message_index=[0, 1, 0, 1], is_content=[True] * 4)
    trace = Trace(id="t", env="e", example_id="1", group_id="g", branches=[branch],
                  messages=[Message(role="user", content="a"), Message(role="assistant", content="b")])
    with pytest.raises(ConversionError, match="trace t branch 0: .* not in one piece"):
        vf_from_trace(trace)
