import numpy as np
import pytest

from tests.algorithms.helpers import chat_branch, make_trace, run
from trace_rl.algorithms import AlgorithmError, load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.data.trace import Branch
from trace_rl.pipeline.channels import sum_channels

# 0 system | 1 user | 2 assistant (sampled, calls search) | 3 tool result | 4 assistant put there by the env
# | 5 user feedback | 6 system notice | 7 assistant (sampled)
MESSAGES = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a", "tool_calls": [{"id": "c1", "name": "search"}]},
    {"role": "tool", "content": "rr", "tool_call_id": "c1"},
    {"role": "assistant", "content": "pp"},
    {"role": "user", "content": "ff"},
    {"role": "system", "content": "nn"},
    {"role": "assistant", "content": "b"},
]
LAYOUT = [(0, 1, False), (1, 1, False), (2, 1, True), (3, 2, False), (4, 2, False), (5, 2, False), (6, 2, False),
          (7, 1, True)]
# token positions: m0 0-2 (content 1) | m1 3-5 (4) | m2 6-8 | m3 9-12 (10, 11) | m4 13-16 (14, 15)
# | m5 17-20 (18, 19) | m6 21-24 (22, 23) | m7 25-27
TOKENS = 28


def trace(trace_id="t", messages=MESSAGES, layout=LAYOUT, **kw):
    return make_trace(trace_id, messages, [chat_branch(layout)], **kw)


def echo(spec, traces):
    channels = run(apply_algorithm(load_algorithm({"id": "echo", **spec}), traces))
    assert all(c.loss == "ce" for c in channels)
    return channels


def positions(channel):
    return np.flatnonzero(channel.mask).tolist()


def test_default_is_tool_results_with_alpha_point_one():
    [channel] = echo({}, [trace()])
    assert positions(channel) == [10, 11]
    np.testing.assert_allclose(channel.values, np.where(np.isin(np.arange(TOKENS), [10, 11]), 0.1, 0.0))


@pytest.mark.parametrize("role, expected", [("system", [22, 23]), ("user", [18, 19]), ("assistant", [14, 15]),
                                            ("tool", [10, 11])])
def test_each_role_alone_trains_its_observations_after_the_first_sampled_message(role, expected):
    spec = {"tool": False, role: {"alpha": 0.5}}
    [channel] = echo(spec, [trace()])
    assert positions(channel) == expected
    assert channel.values[expected].tolist() == [0.5, 0.5] and channel.values.sum() == 1.0


def test_enabled_role_defaults_to_alpha_one_and_roles_combine():
    [channel] = echo({"user": {}, "system": True, "tool": {"alpha": 0.25}}, [trace()])
    assert positions(channel) == [10, 11, 18, 19, 22, 23]
    assert channel.values[[10, 18, 22]].tolist() == [0.25, 1.0, 1.0]


def test_user_feedback_is_trainable_when_user_is_enabled():
    [channel] = echo({"user": {"alpha": 1.0}}, [trace()])
    assert positions(channel) == [10, 11, 18, 19]  # tool keeps its default, user feedback joins


def test_alpha_zero_still_counts_as_echo():
    traces = [trace()]
    [channel] = echo({"tool": False, "user": {"alpha": 0.0}}, traces)
    assert positions(channel) == [18, 19] and not channel.values.any()
    [sample] = sum_channels(traces, [channel])
    assert np.flatnonzero(sample.ce_mask).tolist() == [18, 19] and not sample.ce_values.any()


def test_include_prompt_adds_the_initial_prompt_messages():
    [channel] = echo({"tool": False, "system": {}, "user": {}, "include_prompt": True}, [trace()])
    assert positions(channel) == [1, 4, 18, 19, 22, 23]


@pytest.mark.parametrize("names, expected", [(["search"], [10, 11]), (["calc", "search"], [10, 11]), (["calc"], [])])
def test_tool_names_resolve_the_tool_through_its_call_id(names, expected):
    channels = echo({"tool": {"tool_names": names}}, [trace()])
    assert [positions(c) for c in channels] == ([expected] if expected else [])


def test_tool_names_use_the_result_name():
    messages = [*MESSAGES]
    messages[3] = {"role": "tool", "content": "rr", "name": "calc"}
    [channel] = echo({"tool": {"tool_names": ["calc"], "alpha": 2.0}}, [trace(messages=messages)])
    assert positions(channel) == [10, 11] and channel.values[10] == 2.0


def test_a_filter_narrows_the_selection():
    spec = {"user": {}, "filter": {"import_path": "tests.algorithms.plugins:from_position", "kwargs": {"start": 15}}}
    [channel] = echo(spec, [trace()])
    assert positions(channel) == [18, 19]  # tool tokens 10, 11 filtered out
    np.testing.assert_array_equal(channel.values[[10, 11, 18]], [0.0, 0.0, 1.0])


def test_a_filter_cannot_widen_the_selection():
    [channel] = echo({"filter": {"import_path": "tests.algorithms.plugins:keep_everything"}}, [trace()])
    assert positions(channel) == [10, 11]


@pytest.mark.parametrize("name, message", [
    ("too_short", r"'tests.algorithms.plugins:too_short' returned for trace 't' branch 0 a bool array "
                  r"of shape \(27,\)"),
    ("integer_masks", r"'tests.algorithms.plugins:integer_masks' returned .* int64 array"),
    ("one_mask_only", r"'tests.algorithms.plugins:one_mask_only' must return a list of one bool mask per branch"),
])
def test_a_filter_returning_the_wrong_shape_or_type_is_named(name, message):
    with pytest.raises(AlgorithmError, match=message):
        echo({"filter": {"import_path": f"tests.algorithms.plugins:{name}"}}, [trace()])


def test_an_unimportable_filter_is_rejected_when_loading():
    with pytest.raises(AlgorithmError, match="echo filter 'tests.algorithms.plugins:nope': module 'tests.algorithms.plugins' has no attribute 'nope'"):
        load_algorithm({"id": "echo", "filter": {"import_path": "tests.algorithms.plugins:nope"}})


def test_token_zero_is_never_trained():
    # a second branch that starts directly inside the tool result's content
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "rrr"}]
    first = chat_branch([(0, 1, False), (1, 1, True)])
    second = Branch(token_ids=[7, 8, 9, 3], sampled=[0, 0, 0, 0], logprobs=[0] * 4, message_index=[2, 2, 2, 2],
                    is_content=[1, 1, 1, 0], index=1)
    [channel] = echo({}, [make_trace("t", messages, [first, second])])
    assert channel.branch_index == 1 and positions(channel) == [1, 2]


def test_each_message_is_trained_once_and_the_actors_own_messages_never():
    # branch 1 re-renders the whole conversation (the template could not extend branch 0)
    messages = MESSAGES[:4] + [{"role": "assistant", "content": "b"}]
    branches = [chat_branch([(0, 1, False), (1, 1, False), (2, 1, True)]),
                chat_branch([(0, 1, False), (1, 1, False), (2, 1, False), (3, 2, False), (4, 1, True)], index=1)]
    spec = {"system": {}, "assistant": {}, "include_prompt": True}
    channels = echo(spec, [make_trace("t", messages, branches)])
    # branch 0: system content (1); branch 1: only the tool result (10, 11): the system prompt was trained
    # in branch 0 and the re-rendered assistant message 2 was sampled by the actor in branch 0
    assert [(c.branch_index, positions(c)) for c in channels] == [(0, [1]), (1, [10, 11])]


def test_untrainable_and_errored_traces_get_nothing():
    assert echo({"user": {}}, [trace("judge", trainable=False), trace("broken", error="x")]) == []


@pytest.mark.parametrize("spec, message", [
    ({"tool": False}, "enable at least one of system, user, assistant, tool"),
    ({"tool": {"tool_names": []}}, "tool.tool_names"),
    ({"user": {"alpha": -1}}, "user.alpha"),
    ({"user": {"weight": 1}}, "user.weight: unknown key"),
    ({"roles": ["user"]}, "roles: unknown key"),
])
def test_bad_options_are_named(spec, message):
    with pytest.raises(AlgorithmError, match=message):
        load_algorithm({"id": "echo", **spec})


def test_one_pass_over_all_groups_equals_each_trace_alone():
    """Echo runs once over every group (`per_trace`); traces of different sizes, multi-branch ones, untrainable
    ones and ones without observations in between must each get what they get alone."""
    shared = MESSAGES[:4] + [{"role": "assistant", "content": "b"}]
    two_branches = [chat_branch([(0, 1, False), (1, 1, False), (2, 1, True)]),
                    chat_branch([(0, 1, False), (1, 1, False), (2, 1, False), (3, 2, False), (4, 1, True)],
                                index=1)]
    traces = [
        trace("a", group="g0"),
        make_trace("b", shared, two_branches, group="g1"),
        trace("c", group="g0", trainable=False),
        make_trace("d", MESSAGES[:2], [chat_branch(LAYOUT[:2])], group="g2"),  # nothing sampled: no observations
        trace("e", group="g1"),
    ]
    spec = {"system": {}, "user": {"alpha": 0.5}, "assistant": {}, "include_prompt": False}
    together = echo(spec, traces)
    alone = [channel for t in traces for channel in echo(spec, [t])]
    assert load_algorithm({"id": "echo"}).per_trace
    key = lambda c: (c.trace_id, c.branch_index)
    assert sorted(map(key, together)) == sorted(map(key, alone)) and len(together) == 3
    by_key = {key(c): c for c in alone}
    for channel in together:
        np.testing.assert_array_equal(channel.mask, by_key[key(channel)].mask)
        np.testing.assert_array_equal(channel.values, by_key[key(channel)].values)
