"""The sandbox as verifiers' runtime of a seat: the default of trace-rl's chat harness, a task's `runtime.run`
runs in it, a program killed at a limit fails its rollout, and the host runs a program only when a config says so."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from trace_rl.sandbox import bwrap_lack

pytestmark = pytest.mark.skipif(bwrap_lack() is not None, reason=f"the sandbox needs {bwrap_lack()}")

TASKSETS = [str(Path(__file__).parent / "tasksets")]


def program_env(tools_network: str | None = None, **seat):
    from trace_rl.envs.lookup import load_env

    args = {"taskset": {"id": "program_tasks"}}
    if seat:
        args["agent"] = seat
    if tools_network is not None:
        args["tools_network"] = tools_network
    return load_env("verifiers", args, TASKSETS)


def test_a_tasks_program_runs_sandboxed_by_default_and_one_killed_at_a_limit_fails_its_rollout(
        tiny_model_path, monkeypatch):
    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Sampler
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig
    from trace_rl.pipeline.rollouts import run_rollout
    from trace_rl.sandbox.runtime import BwrapConfig
    from trace_rl.sandbox.sandbox import default_root

    monkeypatch.setenv("TRACE_RL_FAKE_SECRET", "s3cr3t")
    env = program_env()
    assert isinstance(env.config.agent.runtime, BwrapConfig)
    sampler = Sampler(build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf")),
                      SamplingConfig(max_completion_tokens=4), seed=1)
    examples = sorted(env.examples(0, 2), key=lambda example: example.data["task"])

    async def play():
        return await asyncio.gather(*(run_rollout(env, example, sampler, max_retries=0, backoff_s=0)
                                      for example in examples))

    (works, _), (floods, _) = asyncio.run(play())
    assert works[0].error is None and works[0].reward == 1.0
    assert floods[0].error.startswith("EnvError: verifiers episode of task task1 failed: TaskError")
    assert "sandbox: program killed: output over 8388608 bytes" in floods[0].error
    assert not any(path.name.startswith(f"{os.getpid()}-") for path in default_root().iterdir())


def test_the_host_runs_programs_only_when_a_config_says_so_with_one_warning(caplog, monkeypatch):
    import trace_rl.envs.verifiers_env as verifiers_env
    from trace_rl.envs.base import EnvError
    from trace_rl.sandbox.runtime import BwrapConfig

    monkeypatch.setattr(verifiers_env, "_warned_host", False)
    with caplog.at_level(logging.WARNING, logger="trace_rl.envs.verifiers_env"):
        host = [program_env(runtime={"type": "subprocess"}) for _ in range(2)]
    assert not isinstance(host[0].config.agent.runtime, BwrapConfig)
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "args.agent.runtime = { type = \"subprocess\" } runs the programs of its rollouts on this host" in warning
    limited = program_env(runtime={"type": "bwrap", "max_processes": 50, "network": "host"})
    assert limited.config.agent.runtime.sandbox.max_processes == 50
    with pytest.raises(EnvError, match=r"^env 'verifiers': args.agent.runtime.max_procs: Extra inputs are not "
                                       r"permitted \(docs/sandbox.md#keys\)$"):
        program_env(runtime={"type": "bwrap", "max_procs": 50})


def test_every_other_subprocess_runtime_of_verifiers_runs_sandboxed_once_a_verifiers_env_loaded():
    """Tool servers verifiers starts on a subprocess runtime of their own, or a seat config verifiers re-read from
    its fields, run in the sandbox, on a network of their own: a tool server listens on a port of the sandbox's
    own loopback, which verifiers publishes (tests/envs/test_verifiers_tools.py plays one)."""
    from verifiers.v1.runtimes import SubprocessConfig, SubprocessRuntime, make_runtime

    from trace_rl.envs.base import EnvError
    from trace_rl.sandbox.runtime import SERVED_PORT, TOOLS_SANDBOX, BwrapRuntime, HostConfig

    program_env()
    plain = make_runtime(SubprocessConfig())
    assert isinstance(plain, BwrapRuntime) and plain.sandbox.config == TOOLS_SANDBOX
    assert TOOLS_SANDBOX.network == "routes" and plain.published_port == SERVED_PORT
    host = make_runtime(HostConfig())
    assert type(host) is SubprocessRuntime
    with pytest.raises(EnvError, match=r"^env 'verifiers': args.tools_network = 'none': set \"routes\""):
        program_env(tools_network="none")


def test_verifiers_bash_harness_plays_an_episode_in_the_sandbox_reaching_only_its_routes(tiny_model_path):
    """verifiers' `bash` harness installs its program with uv in the sandbox (from PyPI, on the host's network
    during setup) and runs the model's commands there, reaching the sampler through its route only; with
    network = "none" it is refused, as it could not reach the sampler."""
    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import EnvError, Sampler
    from trace_rl.envs.lookup import load_env
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig
    from trace_rl.pipeline.rollouts import run_rollout
    from trace_rl.sandbox.runtime import BwrapConfig

    def bash_env(network: str):
        seat = {"harness": {"id": "bash"}, "max_turns": 2, "runtime": {"type": "bwrap", "network": network}}
        return load_env("verifiers", {"taskset": {"id": "program_tasks"}, "agent": seat}, TASKSETS)

    with pytest.raises(EnvError, match=r"args.agent.runtime.network: a verifiers harness in the sandbox reaches"):
        bash_env("none")
    env = bash_env("routes")
    assert isinstance(env.config.agent.runtime, BwrapConfig)
    sampler = Sampler(build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf",
                                                  max_model_len=2048)),
                      SamplingConfig(max_completion_tokens=8), seed=1)
    example = next(e for e in env.examples(0, 2) if e.data["task"] == 0)
    (trace,), _ = asyncio.run(run_rollout(env, example, sampler, max_retries=0, backoff_s=0))
    assert trace.error is None and trace.reward == 1.0  # its task's program ran sandboxed too
