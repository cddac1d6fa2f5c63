"""verifiers' podman runtime on trace-rl: the default image built here (once per recipe: the engine's store keeps it),
trace-rl's chat harness and verifiers' `bash` and `mini_swe_agent` harnesses reaching the sampler from a container,
tool calls token-exact, the model's programs run in the container with no network but the rollout's routes, one
container a rollout with no network device from its set-up on (`trace_rl.containers.runtime`), and one-line refusals
where the engine (podman or docker) or the image is missing."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.envs.conftest import ScriptedRuntime
from tests.envs.test_verifiers_env import assert_token_exact
from tests.envs.test_verifiers_tools import ScoredScriptedRuntime
from trace_rl.envs.base import EnvError

ROOT = Path(__file__).resolve().parents[2]
CODE_TASKS = str(ROOT / "configs" / "verifiers")
TEST_TASKSETS = str(ROOT / "tests" / "envs" / "verifiers_tasksets")


def containers() -> list[str]:
    listed = subprocess.run(["podman", "ps", "-a", "--filter", "label=verifiers.run", "--format", "{{.Names}}"],
                            capture_output=True, text=True, check=True)
    return listed.stdout.split()


def started_since(since: str) -> list[str]:
    """The containers this process's rollouts started since `since` (podman's events)."""
    import os

    listed = subprocess.run(["podman", "events", "--stream=false", "--since", since, "--filter", "event=start",
                             "--filter", f"label=verifiers.run={os.environ['VF_RUN_ID']}", "--format", "{{.Name}}"],
                            capture_output=True, text=True, check=True)
    return listed.stdout.split()


def now() -> str:
    return subprocess.run(["date", "-u", "+%Y-%m-%dT%H:%M:%S.%NZ"], capture_output=True, text=True).stdout.strip()


def play(env, runtime, task: int):
    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Example, Sampler

    sampler = Sampler(runtime, SamplingConfig(max_completion_tokens=64), seed=0)
    return asyncio.run(env.rollout(Example(id=f"task{task}", data={"task": task}), sampler))


def code_env(**agent):
    from trace_rl.envs.lookup import load_env

    return load_env("verifiers", {"taskset": {"id": "code_tasks"}, "agent": {"runtime": {"type": "podman"}, **agent}},
                    [CODE_TASKS])


def test_the_chat_harness_runs_the_models_program_in_a_container_cut_off_from_the_host(sandbox_image, s3_server,
                                                                                         tiny_model_path):
    from transformers import AutoTokenizer

    env = code_env()
    expected = env.tasks[0].data.expected
    # a server on all the host's addresses (as an S3 endpoint may be), beside the S3 server on the host's loopback
    listener = socket.create_server(("0.0.0.0", 0))
    host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    s3_port = int(s3_server["endpoint_url"].rpartition(":")[2])
    marker = Path("/tmp") / f"trace-rl-container-{uuid.uuid4().hex}"
    targets = [("127.0.0.1", s3_port), (host_ip, listener.getsockname()[1]), ("10.88.0.1", listener.getsockname()[1]),
               ("deb.debian.org", 80)]
    program = (f"import socket, os\nopen({str(marker)!r}, 'w').write('x')\nreached = []\n"
               f"for target in {targets!r}:\n    try:\n        socket.create_connection(target, 3).close()\n"
               f"        reached.append(target)\n    except OSError:\n        pass\n"
               f"devices = os.listdir('/sys/class/net')\n"
               f"print({expected!r} if not reached and devices == ['lo'] and os.path.exists('/etc/debian_version') "
               f"else (reached, devices))")
    runtime = ScriptedRuntime(AutoTokenizer.from_pretrained(tiny_model_path), [f"```python\n{program}\n```"])
    env.vf_env  # noqa: B018 - names this process's run scope (VF_RUN_ID)
    since = now()
    try:
        (trace,) = play(env, runtime, task=0)
    finally:
        listener.close()
    assert trace.error is None and trace.metrics == {"passed": 1.0, "ran": 1.0} and trace.reward == 1.0
    assert not marker.exists()  # it wrote the container's /tmp
    assert trace.messages[0].content == "External network access is disabled."  # verifiers' notice of the cut
    assert len(started_since(since)) == 1  # the rollout's own container, and no helper
    assert containers() == []


def test_the_bash_harness_calls_tools_in_a_container_token_exactly_and_sees_the_model(sandbox_image, tiny_model_path,
                                                                                       caplog):
    from transformers import AutoTokenizer

    import trace_rl.verifiers.client as client

    env = code_env(harness={"id": "bash"})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    replies = ['Checking.<tool_call>{"name": "bash", "arguments": {"command": "python3 -c \'print(6 * 7)\'"}}'
               '</tool_call>', f"print({env.tasks[0].data.expected!r})"]
    runtime = ScoredScriptedRuntime(tiny_model_path, tokenizer, replies)
    # above the harness's compaction threshold, which it takes from /v1/models: max(window - 16384, window / 2)
    runtime.config = runtime.config.model_copy(update={"max_model_len": 4096})
    listed = []
    listing = client.model_listing
    client.model_listing = lambda sampler: listed.append(listing(sampler)) or listed[-1]
    env.vf_env  # noqa: B018 - names this process's run scope (VF_RUN_ID)
    since = now()
    try:
        with caplog.at_level("WARNING"):
            (trace,) = play(env, runtime, task=0)
    finally:
        client.model_listing = listing
    # the harness's set-up (`uv sync --script` of its program) ran in the one container, with no network device and
    # a proxy that lets no host through: the image's own index served it
    assert len(started_since(since)) == 1
    assert trace.error is None and trace.reward == 1.0
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant"]
    (call,) = trace.messages[2].tool_calls
    assert trace.messages[2].content == "Checking." and (call.name, call.arguments) == (
        "bash", {"command": "python3 -c 'print(6 * 7)'"})
    assert trace.messages[3].content == "42\n"
    # the harness asked for the model's context length (its compaction threshold), and got it from trace-rl
    assert [entry["data"][0]["max_model_len"] for entry in listed] == [4096]
    assert not [r for r in caplog.records if "models call failed" in r.getMessage()]
    (branch,) = trace.branches
    assert_token_exact(branch, runtime.prompts, replies, tokenizer, tiny_model_path)
    assert containers() == []


def test_the_mini_swe_agent_harness_plays_an_episode_in_a_container_token_exactly(sandbox_image, tiny_model_path):
    """verifiers' `mini_swe_agent` harness (mini-swe-agent on litellm, installed from the image's wheels with no
    network) reaches the sampler from the container, runs the model's bash tool calls there, and submits."""
    from transformers import AutoTokenizer

    env = code_env(harness={"id": "mini_swe_agent"})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    replies = ['Checking.<tool_call>{"name": "bash", "arguments": {"command": "python3 -c \'print(6 * 7)\'"}}'
               '</tool_call>', 'Done.<tool_call>{"name": "bash", "arguments": {"command": '
               '"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}</tool_call>']
    runtime = ScoredScriptedRuntime(tiny_model_path, tokenizer, replies)
    runtime.config = runtime.config.model_copy(update={"max_model_len": 4096})
    env.vf_env  # noqa: B018 - names this process's run scope (VF_RUN_ID)
    since = now()
    (trace,) = play(env, runtime, task=0)
    assert trace.error is None, trace.error
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant"]
    (call,) = trace.messages[2].tool_calls
    assert (call.name, call.arguments) == ("bash", {"command": "python3 -c 'print(6 * 7)'"})
    assert "42" in trace.messages[3].content
    (branch,) = trace.branches
    assert_token_exact(branch, runtime.prompts, replies, tokenizer, tiny_model_path)
    assert len(started_since(since)) == 1
    assert containers() == []


def test_a_podman_seat_is_refused_in_one_line_without_podman_or_its_image(sandbox_image, monkeypatch):
    with pytest.raises(EnvError) as missing_image:
        code_env(runtime={"type": "podman", "image": "localhost/no-such-image:1"})
    assert str(missing_image.value) == (
        "env 'verifiers': args.agent.runtime.image: podman has no image 'localhost/no-such-image:1' (`podman images` "
        "lists its store; no registry is assumed: build it here, docs/containers.md#images)")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EnvError) as no_podman:
        code_env()
    assert "\n" not in str(no_podman.value) and "needs `podman` on PATH (apt-get install -y podman runc, then " \
        "`trace-rl sandbox build`)" in str(no_podman.value)


def test_a_podman_rollouts_set_up_reaches_no_host_and_installs_from_the_images_index(sandbox_image):
    """From its start, a restricted seat's container has loopback only, and verifiers' egress proxy (set-up runs
    with its address in HTTP(S)_PROXY) lets no host through but the rollout's routes: PyPI is refused, and uv
    installs what verifiers' harnesses install from the wheels baked into the image."""
    import verifiers.v1.runtimes as runtimes
    from verifiers.v1.runtimes.container import cli
    from verifiers.v1.runtimes.docker import PodmanConfig

    from trace_rl.containers.runtime import RoutedPodmanRuntime, install

    install()
    fetch = "import urllib.request\ntry:\n    urllib.request.urlopen('https://pypi.org/simple/uv/', timeout=10)\n" \
        "except Exception as exc:\n    print(exc)"
    uv = "uv venv -q /tmp/v && uv pip install -q --python /tmp/v/bin/python openai && /tmp/v/bin/python -c " \
        "'import openai; print(openai.__name__)'"

    status = ["sh", "-c", "grep -E 'Cap(Eff|Bnd)|NoNewPrivs|Seccomp:' /proc/self/status; cat /proc/self/cgroup; id"]

    async def set_up():
        runtime = runtimes.make_runtime(PodmanConfig(image=sandbox_image, allow=[]))
        try:
            await runtime.start()
            await runtime.prepare_setup()
            # its programs run with `runc exec`, confined as `podman exec` confines them
            confined = await runtime.run(status, {}), await cli("podman", "exec", runtime._container, *status)
            return (type(runtime), runtime._exec({})[0], confined, await runtime.run(["python3", "-c", fetch], {}),
                    await runtime.run(["sh", "-c", uv], {}), await runtime.run(["ls", "/sys/class/net"], {}))
        finally:
            await runtime.stop()

    kind, executable, (by_runc, by_podman), fetched, installed, devices = asyncio.run(set_up())
    assert kind is RoutedPodmanRuntime and executable == "runc"
    assert by_runc.stdout == by_podman.stdout and "NoNewPrivs:\t1" in by_runc.stdout, (by_runc, by_podman)
    assert "403" in fetched.stdout and "Forbidden" in fetched.stdout, fetched
    assert installed.exit_code == 0 and installed.stdout == "openai\n", installed
    assert devices.stdout == "lo\n"
    assert containers() == []


def test_a_docker_seat_is_refused_in_one_line_where_docker_is_missing(monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EnvError) as refused:
        code_env(runtime={"type": "docker"})
    assert str(refused.value) == (
        "env 'verifiers': args.agent: harness 'trace-rl-chat' runs in the 'docker' runtime, which needs `docker` on "
        "PATH (apt-get install -y docker.io, then `trace-rl sandbox build --engine docker`); this machine lacks it: "
        "give the seat another runtime (args.agent.runtime) or trace-rl's chat harness (args.agent.harness = "
        "{ id = \"trace-rl-chat\" })")
    assert main(["sandbox", "build", "--engine", "docker"]) == 2
    assert capsys.readouterr().err == "error: `docker` is not installed: apt-get install -y docker.io " \
        "(docs/containers.md)\n"


def test_sandbox_build_keeps_the_built_image_and_names_it(sandbox_image, capsys):
    from flows.cli import main

    assert main(["sandbox", "build"]) == 0
    assert capsys.readouterr().out.strip() == sandbox_image
    inspected = json.loads(subprocess.run(["podman", "image", "inspect", sandbox_image], capture_output=True,
                                          text=True, check=True).stdout)[0]["Config"]
    assert inspected["StopSignal"] in ("9", "SIGKILL") and "UV_DEFAULT_INDEX=file:///opt/trace-rl/simple" in \
        inspected["Env"]
    offline = subprocess.run(["podman", "run", "--rm", "--network", "none", sandbox_image, "sh", "-c",
                              "uv venv -q /tmp/v && uv pip install -q --python /tmp/v/bin/python mcp==2.0.0 openai"],
                             capture_output=True, text=True)
    assert offline.returncode == 0, offline.stderr  # the harness's wheels install with no network


def test_a_container_that_does_not_start_is_a_retryable_rollout_error(sandbox_image, tiny_model_path):
    """podman's run fails (here: runc cannot hold the container under a 100 KiB memory limit; under many concurrent
    starts, a host port that another start took): the rollout loop retries such a rollout (`inference.max_retries`)."""
    from transformers import AutoTokenizer

    from trace_rl.errors import RetryableError

    env = code_env(runtime={"type": "podman", "memory": 0.0001})
    runtime = ScriptedRuntime(AutoTokenizer.from_pretrained(tiny_model_path), ["print(1)"])
    with pytest.raises(RetryableError, match="SandboxError: podman run failed: Error: OCI runtime error"):
        play(env, runtime, task=0)
    assert containers() == []


def test_the_containers_of_a_killed_process_are_removed_when_the_env_loads_again(sandbox_image, tiny_model_path):
    import os
    import select
    import sys

    child_env = {key: value for key, value in os.environ.items() if key != "VF_RUN_ID"}
    child = subprocess.Popen([sys.executable, "-m", "tests.containers.killed_rollout", tiny_model_path], cwd=ROOT,
                             env=child_env, stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([child.stdout], [], [], 120)[0] and child.stdout.readline().strip() == "started"
    finally:
        child.kill()
        child.wait()
    assert len(containers()) == 1  # its rollout's container outlives it: nothing in it ran verifiers' cleanup
    code_env().vf_env  # noqa: B018 - a run that loads the env again (`--resume`) sweeps it
    assert containers() == []
