"""The wire keeps its word: protocol version 1 bodies, old and new, against a real env server on loopback."""

from __future__ import annotations

import json

import httpx
import numpy as np

from tests.algorithms.helpers import chat_branch, make_trace
from tests.remote.conftest import auth
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.data.trace import Branch, Message, ToolCall, Trace
from trace_rl.remote.wire import RunRequest, WireTrace

# What a version-1 client sent before traces renamed `policy_version` to `policy_step`: written by the
# client of commit b39e65f^ (RunRequest with `traces: list[dict]`, each `Trace.to_dict()`).
OLD_CLIENT_BODY = (
    '{"version":1,"algorithms":[{"id":"position_signal"}],"models":{},"traces":[{"id":"t0","env":"toy",'
    '"example_id":"e0","group_id":"g0","agent":"policy-agent","trainable":true,"reward":1.0,"rewards":{},'
    '"metrics":{},"info":{},"messages":[{"role":"user","content":"ab"},{"role":"assistant","content":"ba"}],'
    '"error":null,"policy_version":3,"branches":[{"index":0,"temperature":1.0,"token_ids":[10,11,12,13,14,15],'
    '"sampled":[false,false,false,true,true,true],"logprobs":[0.0,0.0,0.0,-0.5,-0.25,-1.0000000031710769e-30],'
    '"message_index":[0,0,0,1,1,1],"is_content":[false,true,false,true,true,false],"advantages":null,'
    '"mask":null}]}]}'
)


def the_old_clients_trace() -> Trace:
    branch = Branch(token_ids=np.arange(6) + 10, sampled=[0, 0, 0, 1, 1, 1], logprobs=[0, 0, 0, -0.5, -0.25, -1e-30],
                    message_index=[0, 0, 0, 1, 1, 1], is_content=[0, 1, 0, 1, 1, 0])
    return Trace(id="t0", env="toy", example_id="e0", group_id="g0", branches=[branch], reward=1.0, policy_step=3,
                 messages=[Message(role="user", content="ab"), Message(role="assistant", content="ba")])


def post_run(url: str, body: str | dict) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{url}/run_algorithms", content=content, headers=auth(), timeout=30)


def test_todays_client_writes_the_old_body_but_for_the_renamed_field():
    body = RunRequest(algorithms=[AlgorithmConfig(id="position_signal")],
                      traces=[WireTrace.of(the_old_clients_trace())]).model_dump_json()
    assert body == OLD_CLIENT_BODY.replace('"policy_version":3', '"policy_step":3')


def test_an_old_clients_policy_version_is_read_as_policy_step():
    [old] = RunRequest.model_validate_json(OLD_CLIENT_BODY).traces
    trace = old.to_trace()
    assert trace.policy_step == 3
    assert trace.equals(the_old_clients_trace())
    assert trace.branches[0].logprobs[-1] == np.float32(-1e-30)


def test_an_old_clients_request_runs_like_todays(server):
    old = post_run(server, OLD_CLIENT_BODY)
    new = post_run(server, OLD_CLIENT_BODY.replace('"policy_version"', '"policy_step"'))
    assert old.status_code == new.status_code == 200, old.text
    [old_result], [new_result] = old.json()["results"], new.json()["results"]
    assert old_result["channels"] == new_result["channels"]
    [channel] = old_result["channels"]
    assert channel["mask"] == [False, False, False, True, True, True]  # position_signal: the sampled tokens
    assert channel["values"] == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5]  # and 0.25 * (t + 1) at token t


def test_a_request_with_both_names_is_refused_naming_them(server):
    body = json.loads(OLD_CLIENT_BODY)
    body["traces"][0]["policy_step"] = 3
    reply = post_run(server, body)
    assert reply.status_code == 422
    assert reply.json()["error"] == (
        "malformed run_algorithms request (protocol version 1): traces.0: Value error, both 'policy_version' and "
        "'policy_step' given: policy_version is the old name of policy_step in protocol version 1; send one of them")


def test_a_misspelled_or_mistyped_trace_field_is_422_naming_it_and_the_protocol_version(server):
    misspelled = json.loads(OLD_CLIENT_BODY)
    misspelled["traces"][0]["polcy_step"] = misspelled["traces"][0].pop("policy_version")
    reply = post_run(server, misspelled)
    assert reply.status_code == 422
    assert reply.json()["error"] == ("malformed run_algorithms request (protocol version 1): "
                                     "traces.0.polcy_step: Extra inputs are not permitted")

    trace = make_trace("t0", [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}],
                       [chat_branch([(0, 2, False), (1, 2, True)]), chat_branch([(0, 2, False), (1, 1, True)], 1)])
    mistyped = json.loads(RunRequest(algorithms=[AlgorithmConfig(id="position_signal")],
                                     traces=[WireTrace.of(trace)]).model_dump_json())
    mistyped["traces"][0]["branches"][1]["token_ids"][2] = 2**31  # past int32
    reply = post_run(server, mistyped)
    assert reply.status_code == 422
    assert reply.json()["error"] == (
        "malformed run_algorithms request (protocol version 1): "
        "traces.0.branches.1.token_ids.2: Input should be less than or equal to 2147483647")


def test_a_trace_breaking_the_trace_model_is_422_naming_its_position(server):
    body = json.loads(OLD_CLIENT_BODY)
    body["traces"][0]["branches"][0]["message_index"][0] = 2  # the trace has two messages
    reply = post_run(server, body)
    assert reply.status_code == 422
    assert reply.json()["error"] == ("malformed trace traces.0 (protocol version 1): trace t0 branch 0: "
                                     "message_index 2 out of range for 2 messages")


def test_another_protocol_version_is_refused_saying_which_the_server_speaks(server):
    body = json.loads(OLD_CLIENT_BODY)
    body["version"] = 2
    body["traces"][0]["tokens"] = body["traces"][0].pop("branches")  # another version may say it otherwise
    reply = post_run(server, body)
    assert reply.status_code == 400
    assert reply.json()["error"] == "protocol version 2 is not supported; this server speaks protocol version 1"


def test_messages_travel_without_their_unset_fields():
    trace = make_trace("t0", [{"role": "user", "content": "ab"},
                              {"role": "assistant", "content": "", "tool_calls": [ToolCall(id="c", name="f")]}],
                       [chat_branch([(0, 2, False), (1, 2, True)])])
    [wire] = json.loads(RunRequest(algorithms=[], traces=[WireTrace.of(trace)]).model_dump_json())["traces"]
    assert wire["messages"] == [{"role": "user", "content": "ab"},
                                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "name": "f",
                                                                                     "arguments": {}}]}]
    assert wire == json.loads(trace.to_json())


def test_an_untrainable_branch_travels_as_one_and_a_trainable_one_as_before():
    trace = make_trace("t0", [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}],
                       [chat_branch([(0, 2, False), (1, 2, True)]), chat_branch([(0, 2, False), (1, 3, True)], index=1)])
    trace.branches[1].trainable = False
    [wire] = json.loads(RunRequest(algorithms=[], traces=[WireTrace.of(trace)]).model_dump_json())["traces"]
    assert ["trainable" in branch for branch in wire["branches"]] == [False, True]
    assert not any("policy_versions" in branch for branch in wire["branches"])  # not recorded: not sent
    assert WireTrace.model_validate(wire).to_trace().equals(trace)
