"""The env server and its client against real server processes on loopback."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time

import httpx
import numpy as np
import pytest

from tests.algorithms.helpers import chat_branch, make_trace, reward_trace, run
from tests.conftest import free_port
from tests.remote.conftest import TOKEN, TOKEN_ENV, auth, env_server, get_health, server_command
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.algorithms.distill import OPD
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.config import EnvConfig, RemoteConfig
from trace_rl.data.trace import Branch, Message, ToolCall, Trace
from trace_rl.data.validate import DimensionError
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.remote import RemoteAlgorithmError, remote_server_for, run_remote_algorithm
from trace_rl.remote.server import is_loopback
from trace_rl.remote.wire import RunRequest

FAST = RemoteConfig(timeout_s=30, max_retries=0, retry_backoff_s=0.05, token_env=TOKEN_ENV)


def two_groups() -> list[Trace]:
    """Group g0: t0 and the untrainable t1 (position_signal leaves it alone); group g1: t2 with two branches."""
    return [reward_trace("t0", 1.0, group="g0"), reward_trace("t1", -1.0, group="g0", trainable=False),
            make_trace("t2", [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}],
                       [chat_branch([(0, 3, False), (1, 3, True)]), chat_branch([(0, 3, False), (1, 1, True)], 1)],
                       group="g1", reward=2.0)]


def sampled_after_first(branch: Branch) -> np.ndarray:
    mask = branch.sampled.copy()
    mask[0] = False
    return mask


def test_health_lists_what_the_module_registered(server):
    health = get_health(server)
    assert health.status_code == 200
    assert health.json() == {"version": 1, "envs": ["remote-reverse-text"],
                             "algorithms": ["one_short", "position_signal", "remote_opd", "slow_once", "step_centred"]}


def test_a_whole_step_algorithm_gets_every_group_in_one_request(server, token):
    # three groups; the mean over the whole step's ok rewards (1, 0, 2, 5) is 2: split per group it would be 0
    traces = [reward_trace("a", 1.0, group="g0"), reward_trace("b", 0.0, group="g1"),
              reward_trace("c", 2.0, group="g1"), reward_trace("d", 5.0, group="g2"),
              reward_trace("x", 9.0, group="g2", trainable=False)]
    expected = {"a": -1.0, "b": -2.0, "c": 0.0, "d": 3.0}
    channels = run(run_remote_algorithm(server, "step_centred", traces, {}, FAST))
    assert {c.trace_id: float(c.values[-1]) for c in channels} == expected
    # one group alone is refused (409): the server would compute a per-group mean; the client then resends the step
    body = RunRequest(algorithms=[AlgorithmConfig(id="step_centred")], traces=[]).model_dump_json()
    reply = httpx.post(f"{server}/run_algorithms", content=body, headers={**auth(), "Content-Type": "application/json"},
                       timeout=10)
    assert reply.status_code == 409 and "needs the whole step in one request" in reply.json()["error"]


def test_channels_come_back_exactly_as_the_algorithm_set_them(server, token):
    traces = two_groups()
    channels = run(run_remote_algorithm(server, {"id": "position_signal", "scale": 0.1}, traces, {}, FAST))
    # group by group; the untrainable t1 left alone, so absent
    assert [(c.trace_id, c.branch_index) for c in channels] == [("t0", 0), ("t2", 0), ("t2", 1)]
    branches = {(t.id, b.index): b for t in traces for b in t.branches}
    for channel in channels:
        branch = branches[(channel.trace_id, channel.branch_index)]
        expected = (0.1 * np.arange(1, len(branch) + 1)).astype(np.float32)
        assert channel.algorithm_id == "position_signal" and channel.loss == "rl"
        assert channel.values.dtype == np.float32 and np.array_equal(channel.values, expected)
        assert np.array_equal(channel.mask, sampled_after_first(branch))
    assert channels[0].values[:3].tolist() == [np.float32(0.1), np.float32(0.2), np.float32(0.3)]


def test_a_remote_algorithm_scores_with_the_model_its_runtime_config_names(server, token):
    """remote_opd builds the tiny:1 reference from plain data on the server; its channels equal local opd's."""
    from trace_rl.inference.hf import HFRuntime

    reference = RuntimeConfig(key="reference", name="tiny:1")
    traces = two_groups()
    remote = run(run_remote_algorithm(server, "remote_opd", traces, {"reference": reference}, FAST))

    async def local_opd():
        algorithm = OPD(AlgorithmConfig(id="opd"))
        await algorithm.setup({"reference": HFRuntime(reference)})
        return await apply_algorithm(algorithm, traces)

    local = run(local_opd())
    assert [(c.trace_id, c.branch_index) for c in remote] == [(c.trace_id, c.branch_index) for c in local]
    assert len(remote) == 3
    for mine, theirs in zip(remote, local):
        assert np.array_equal(mine.mask, theirs.mask) and mine.mask.any()
        assert np.array_equal(mine.values, theirs.values)
        assert (mine.values[mine.mask] != 0).all()


def test_wrong_or_missing_token_is_401_and_not_retried(server, monkeypatch):
    assert get_health(server, "wrong").status_code == 401
    assert httpx.get(f"{server}/health", timeout=10).status_code == 401
    monkeypatch.setenv(TOKEN_ENV, "wrong")
    options = FAST.model_copy(update={"max_retries": 3, "retry_backoff_s": 5.0})
    started = time.monotonic()
    with pytest.raises(RemoteAlgorithmError, match="HTTP 401: missing or wrong bearer token") as caught:
        run(run_remote_algorithm(server, "position_signal", two_groups()[:1], {}, options))
    assert server in str(caught.value) and "'position_signal'" in str(caught.value)
    assert time.monotonic() - started < 5  # no backoff: a wrong token does not get better


def test_oversize_request_is_413(server, token):
    huge = make_trace("big", [{"role": "user", "content": "a"}], [chat_branch([(0, 20_000, False)])])
    body = RunRequest(algorithms=[AlgorithmConfig(id="position_signal")], traces=[huge.to_dict()]).model_dump_json()
    reply = httpx.post(f"{server}/run_algorithms", content=body, headers=auth(), timeout=30)
    assert reply.status_code == 413
    assert "exceeds the server's limit of 52428 bytes (--max-request-mb)" in reply.json()["error"]
    with pytest.raises(RemoteAlgorithmError, match="HTTP 413"):
        run(run_remote_algorithm(server, "position_signal", [huge], {}, FAST))


def test_unknown_algorithm_is_a_clear_refusal(server, token):
    with pytest.raises(RemoteAlgorithmError, match="HTTP 403: algorithm 'nope' is not on this server's allow-list"):
        run(run_remote_algorithm(server, "nope", two_groups(), {}, FAST))


def test_a_reply_that_does_not_fit_its_branch_names_server_algorithm_trace_and_branch(server, token):
    traces = two_groups()[:2]
    with pytest.raises(DimensionError) as caught:
        run(run_remote_algorithm(server, "one_short", traces, {}, FAST))
    assert str(caught.value) == (f"env server {server}: env 'toy' trace 't1' branch 0 algorithm 'one_short': "
                                 "values has shape (7,) but the branch has 8 tokens")


class FlakyProxy:
    """A real HTTP server on loopback answering the first `garbage` requests with broken JSON, then
    forwarding to the env server: stands in for a reply mangled on its way back."""

    def __init__(self, target: str, garbage: int):
        import http.server

        self.target, self.garbage, self.requests = target, garbage, 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.requests += 1
                if proxy.requests <= proxy.garbage:
                    status, content = 200, b'{"version": 1, "results": [{"algorithm_id": "position_signal"'
                else:
                    reply = httpx.post(proxy.target + self.path, content=body, timeout=30,
                                       headers={"Authorization": self.headers["Authorization"]})
                    status, content = reply.status_code, reply.content
                self.send_response(status)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"

    def __enter__(self):
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.http.shutdown()
        self.http.server_close()


def test_malformed_replies_are_retried_then_fail_clearly(server, token):
    options = FAST.model_copy(update={"max_retries": 2})
    with FlakyProxy(server, garbage=2) as proxy:
        channels = run(run_remote_algorithm(proxy.url, "position_signal", two_groups()[:1], {}, options))
        assert proxy.requests == 3 and [c.trace_id for c in channels] == ["t0"]
    with FlakyProxy(server, garbage=10) as proxy:
        with pytest.raises(RemoteAlgorithmError) as caught:
            run(run_remote_algorithm(proxy.url, "position_signal", two_groups()[:1], {}, options))
        assert proxy.requests == 3
    message = str(caught.value)
    assert message.startswith(f"env server {proxy.url}: algorithm 'position_signal' on group 'g0' failed after "
                              "3 attempts (remote.max_retries = 2); last error: malformed reply: ")


def test_slow_server_times_out_then_the_retry_succeeds(server, token, tmp_path, caplog):
    options = FAST.model_copy(update={"timeout_s": 1.0, "max_retries": 2})
    algorithm = {"id": "slow_once", "sleep_s": 4.0, "marker": str(tmp_path / "slept")}
    started = time.monotonic()
    channels = run(run_remote_algorithm(server, algorithm, two_groups()[:1], {}, options))
    assert time.monotonic() - started >= 1.0
    assert (tmp_path / "slept").exists()
    assert "no reply within 1s (remote.timeout_s); retry 1/2" in caplog.text
    [channel] = channels
    assert channel.loss == "ce" and np.array_equal(channel.values, np.full(8, 2.0, np.float32))


def test_server_down_then_back(token, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    traces = two_groups()[:1]
    with pytest.raises(RemoteAlgorithmError) as caught:
        run(run_remote_algorithm(url, "position_signal", traces, {}, FAST.model_copy(update={"max_retries": 1})))
    assert f"env server {url}: algorithm 'position_signal' on group 'g0' failed after 2 attempts" in str(caught.value)
    assert "cannot reach the server (ConnectError" in str(caught.value)

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    patient = FAST.model_copy(update={"max_retries": 8, "retry_backoff_s": 0.25})  # up to 64 s of backoff

    async def call_while_the_server_starts():
        request = asyncio.create_task(run_remote_algorithm(url, "position_signal", traces, {}, patient))
        await asyncio.sleep(0.5)
        assert not request.done()
        with env_server("--token-file", str(token_file), port=port):
            return await request, await run_remote_algorithm(url, "position_signal", traces, {}, FAST)

    retried, later = run(call_while_the_server_starts())
    assert [c.trace_id for c in retried] == [c.trace_id for c in later] == ["t0"]
    assert np.array_equal(retried[0].values, later[0].values)


def test_limits_answer_504_and_503_with_their_names(tmp_path):
    body = RunRequest(algorithms=[AlgorithmConfig(id="slow_once", sleep_s=3.0, marker=str(tmp_path / "m"))],
                      traces=[reward_trace("t0", 1.0).to_dict()]).model_dump_json()
    with env_server("--request-timeout-s", "1", "--max-concurrent", "1") as url:

        async def two_at_once():
            async with httpx.AsyncClient(timeout=30) as client:
                slow = asyncio.create_task(client.post(f"{url}/run_algorithms", content=body))
                await asyncio.sleep(0.3)
                busy = await client.post(f"{url}/run_algorithms", content=body)
                return await slow, busy

        slow, busy = run(two_at_once())
    assert slow.status_code == 504
    assert slow.json() == {"error": "run_algorithms took longer than the server's limit of 1s (--request-timeout-s)"}
    assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
    assert busy.json()["error"] == ("server busy: 1 requests in flight, the limit is 1 (--max-concurrent); "
                                    "retry later")


def test_refuses_to_bind_beyond_loopback_without_a_token():
    done = subprocess.run(server_command("--host", "0.0.0.0", "--port", str(free_port())), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "refusing to bind '0.0.0.0' without a token" in done.stderr
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


def test_traces_round_trip_the_wire_exactly():
    trace = make_trace("t0", [{"role": "user", "content": "é\u2603"},
                              {"role": "assistant", "content": "", "tool_calls": [ToolCall(id="c", name="f",
                                                                                          arguments={"x": [1, 2.5]})]}],
                       [chat_branch([(0, 3, False), (1, 2, True)], logprob=-1e-30),
                        chat_branch([(0, 1, False), (1, 4, True)], index=1, temperature=0.7)],
                       reward=1 / 3, rewards={"a": 0.1}, metrics={"m": float("nan")}, info={"answer": {"k": [None]}})
    trace.branches[0].logprobs[-1] = np.float32(-3.4028235e38)
    trace.branches[1].advantages = np.float32([0.1, -0.0, 1e-45, 3, 4, 5, 6, 7, 8])  # the branch's 9 tokens
    trace.branches[1].mask = np.arange(len(trace.branches[1])) % 2 == 1
    trace.branches[1].policy_versions = np.where(trace.branches[1].sampled, [0, 0, 0, 0, 0, 4, 4, 5, 5], -1).astype(np.int32)
    wire = RunRequest(algorithms=[AlgorithmConfig(id="x", a={"b": 1})], traces=[trace.to_dict()]).model_dump_json()
    back = RunRequest.model_validate_json(wire)
    restored = back.traces[0].to_trace()
    assert np.isnan(restored.metrics.pop("m")) and np.isnan(trace.metrics.pop("m"))
    assert restored.equals(trace)
    assert back.algorithms[0].options == {"a": {"b": 1}}
    assert json.loads(wire)["version"] == 1
    assert isinstance(restored.messages[1], Message)


def test_only_algorithms_unknown_here_go_to_the_env_server():
    env = EnvConfig(id="reverse-text", server="http://127.0.0.1:9")
    assert remote_server_for(env, AlgorithmConfig(id="position_signal")) == "http://127.0.0.1:9"
    assert remote_server_for(env, AlgorithmConfig(id="grpo")) is None
    assert remote_server_for(env, AlgorithmConfig(id="tests.algorithms.plugins:LastTokenBonus")) is None
    assert remote_server_for(EnvConfig(id="reverse-text"), AlgorithmConfig(id="position_signal")) is None


def post_run(url: str, body: str, token: str = TOKEN) -> httpx.Response:
    return httpx.post(f"{url}/run_algorithms", content=body, headers=auth(token), timeout=30)


def position_request(algorithm_id: str = "position_signal", **options) -> str:
    return RunRequest(algorithms=[AlgorithmConfig(id=algorithm_id, **options)],
                      traces=[reward_trace("t0", 1.0).to_dict()]).model_dump_json()


def test_a_client_cannot_make_the_server_import_a_module(tmp_path, monkeypatch):
    """`tests.remote.unlisted` writes a marker file when imported: naming it in a request, as an algorithm or as
    echo's filter, must not import it."""
    marker = tmp_path / "imported"
    monkeypatch.setenv("TRACE_RL_TEST_IMPORT_MARKER", str(marker))
    with env_server(allow="tests.remote.algos:PositionSignal") as url:
        assert get_health(url).json() == {"version": 1, "envs": [], "algorithms": ["position_signal"]}
        refused = post_run(url, position_request("tests.remote.unlisted:Unlisted"))
        other = post_run(url, position_request("slow_once"))  # registered by the module, but not allowed
        by_path = post_run(url, position_request("tests.remote.algos:PositionSignal"))
        allowed, builtin = post_run(url, position_request()), post_run(url, position_request("grpo"))
        # a builtin that imports what it is told: echo's filter
        filtered = post_run(url, position_request("echo", assistant=True,
                                                  filter={"import_path": "tests.remote.unlisted:Unlisted"}))
    assert refused.status_code == 403 and not marker.exists()
    assert filtered.status_code == 403 and "echo's `filter` names code to import" in filtered.json()["error"]
    assert refused.json()["error"] == ("algorithm 'tests.remote.unlisted:Unlisted' is not on this server's allow-list "
                                       "(position_signal); start the server with --allow module:Class for it")
    assert other.status_code == 403 and "'slow_once' is not on this server's allow-list" in other.json()["error"]
    assert by_path.status_code == allowed.status_code == builtin.status_code == 200
    channels = [reply.json()["results"][0]["channels"] for reply in (allowed, by_path, builtin)]
    assert channels[0] == channels[1] != channels[2] and channels[0]


@pytest.mark.parametrize("entry, problem", [
    ("tests.remote.algos:Nope", "--allow 'tests.remote.algos:Nope': module 'tests.remote.algos' has no attribute "
                                "'Nope'; check the name after ':'"),
    ("tests.remote.no_such_module", "--allow 'tests.remote.no_such_module': module 'tests.remote.no_such_module' "
                                    "was not found on sys.path"),
    ("json", "--allow 'json': importing it registered no algorithm or env"),
])
def test_a_bad_allow_entry_stops_the_server_at_start(entry, problem):
    done = subprocess.run(server_command("--port", str(free_port()), allow=entry), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and problem in done.stderr


def test_requests_beyond_the_rate_limit_are_429_per_token(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\nsecond-client-token\n")
    with env_server("--token-file", str(tokens), "--rate-limit", "0.5") as url:  # a burst of 1, then one per 2 s
        first, second = post_run(url, position_request()), post_run(url, position_request())
        other_client = post_run(url, position_request(), token="second-client-token")
        time.sleep(2.1)
        later = post_run(url, position_request())
    assert first.status_code == 200 and other_client.status_code == 200 and later.status_code == 200
    assert second.status_code == 429 and second.headers["Retry-After"] == "2"
    assert second.json()["error"] == ("rate limit: more than 0.5 requests per second with this token (--rate-limit); "
                                      "retry later")


def test_deeply_nested_json_is_400_and_never_parsed_deep(server, token):
    deep = 20_000  # 40 kB: under the shared server's 0.05 MiB limit
    body = ('{"version": 1, "algorithms": [{"id": "position_signal"}], "traces": [{"id": ' + "[" * deep
            + "]" * deep + "}]}")
    reply = post_run(server, body)
    assert reply.status_code == 400
    assert reply.json()["error"].startswith("the request body is not JSON the server reads: body: Invalid JSON: "
                                            "recursion limit exceeded")
    assert post_run(server, "{not json").status_code == 400
    assert post_run(server, '{"version": 1, "algorithms": [], "traces": [7]}').status_code == 422


def test_the_runtime_cache_keeps_the_most_recently_used():
    from trace_rl.remote.server import RuntimeCache

    cache = RuntimeCache(2)
    one, two, three = (RuntimeConfig(key="reference", name=f"tiny:{seed}") for seed in (1, 2, 3))
    first = cache.get(one)
    cache.get(two)
    assert cache.get(one) is first  # used again: now the most recent
    cache.get(three)  # evicts two, the least recently used
    assert [RuntimeConfig.model_validate_json(k).name for k in cache.built] == ["tiny:1", "tiny:3"]
    assert cache.get(one) is first and cache.get(two) is not None and len(cache.built) == 2
