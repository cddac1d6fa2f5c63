"""verifiers' docker runtime on trace-rl: the default image imported into docker's store (`trace-rl sandbox build
--engine docker`), and trace-rl's chat harness and verifiers' `bash` harness reaching the sampler from a docker
container, the model's program run there with the network cut, nothing left after the rollout."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.containers.test_podman import CODE_TASKS, play
from tests.envs.conftest import ScriptedRuntime
from tests.envs.test_verifiers_env import assert_token_exact
from tests.envs.test_verifiers_tools import ScoredScriptedRuntime


@pytest.fixture(scope="module")
def docker_image():
    """The default image in docker's store; skipped where docker's daemon is not installed (.ci/run installs it)."""
    if shutil.which("dockerd") is None:
        pytest.skip("docker is not installed here (apt-get install -y docker.io, as .ci/run does)")
    from trace_rl.containers.engine import engine_problem
    from trace_rl.containers.image import build

    problem = engine_problem("docker")
    assert problem is None, problem
    return build(engine="docker")


def docker_containers() -> list[str]:
    listed = subprocess.run(["docker", "ps", "-a", "--filter", "label=verifiers.run", "--format", "{{.Names}}"],
                            capture_output=True, text=True, check=True)
    return listed.stdout.split()


def docker_env(**agent):
    from trace_rl.envs.lookup import load_env

    return load_env("verifiers", {"taskset": {"id": "code_tasks"}, "agent": {"runtime": {"type": "docker"}, **agent}},
                    [CODE_TASKS])


def test_the_chat_and_bash_harnesses_play_in_docker_containers_cut_off_from_the_network(docker_image,
                                                                                        tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    chat = docker_env()
    expected = chat.tasks[0].data.expected
    program = ("import os, socket\ntry:\n    socket.create_connection(('deb.debian.org', 80), 3).close()\n"
               "    reached = True\nexcept OSError:\n    reached = False\n"
               f"print({expected!r} if not reached and os.path.exists('/etc/debian_version') else 'reached')")
    (trace,) = play(chat, ScriptedRuntime(tokenizer, [f"```python\n{program}\n```"]), task=0)
    assert trace.error is None and trace.metrics == {"passed": 1.0, "ran": 1.0} and trace.reward == 1.0
    assert trace.messages[0].content == "External network access is disabled."  # verifiers' notice of the cut

    bash = docker_env(harness={"id": "bash"})
    replies = ['Checking.<tool_call>{"name": "bash", "arguments": {"command": "python3 -c \'print(6 * 7)\'"}}'
               '</tool_call>', f"print({expected!r})"]
    runtime = ScoredScriptedRuntime(tiny_model_path, tokenizer, replies)
    runtime.config = runtime.config.model_copy(update={"max_model_len": 4096})
    (trace,) = play(bash, runtime, task=0)
    assert trace.error is None and trace.reward == 1.0
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trace.messages[3].content == "42\n"
    (branch,) = trace.branches
    assert_token_exact(branch, runtime.prompts, replies, tokenizer, tiny_model_path)
    assert docker_containers() == []
