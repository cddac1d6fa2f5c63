"""The `verifiers` env on a verifiers env server (`server = "tcp://..."`): the server, in its own process, plays the
episodes and samples the policy from the session's vLLM server (`/inference/v1/generate`); the traces it streams
back train token-exactly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import free_port
from tests.envs.test_verifiers_env import recomputed_logprobs, verifiers_run
from trace_rl.config import ConfigError, config_to_toml
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_traces

ROOT = Path(__file__).resolve().parents[2]


def served_run(tmp_path, name: str, address: str, base_url: str | None) -> dict:
    data = verifiers_run(str(tmp_path), name, "addition_tasks")
    data["env"][0]["server"] = address
    if base_url is not None:
        data["inference"] = {"backend": "vllm", "base_url": base_url}
    return data


def answers(address: str) -> bool:
    from trace_rl.runs.preflight import verifiers_server_answers

    return asyncio.run(verifiers_server_answers(address))


def start_env_server(config_path: Path, address: str, log) -> subprocess.Popen:
    """`trace-rl verifiers-env-server CONFIG` in its own process group; returns once it answers."""
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "verifiers-env-server", str(config_path)],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                               stderr=subprocess.STDOUT, process_group=0)
    deadline = time.monotonic() + 120
    while not answers(address):
        assert process.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
    return process


@pytest.mark.vllm
def test_a_verifiers_env_server_plays_the_episodes_token_exactly(prefect_api, tmp_path, vllm_server,
                                                                  tiny_model_path):
    from flows.train import run_training
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig

    address = f"tcp://127.0.0.1:{free_port()}"
    config = validate_config(served_run(tmp_path, "vf-served", address, vllm_server.url))
    config_path = tmp_path / "vf-served.toml"
    config_path.write_text(config_to_toml(config))
    with open(tmp_path / "env-server.log", "w") as log:
        server = start_env_server(config_path, address, log)
    generated = vllm_server.log_path.read_text().count("POST /inference/v1/generate")
    try:
        run_training(config)
        # every turn was the env server's request to the vLLM server: 2 steps x 2 tasks x 2 episodes of one turn
        assert vllm_server.log_path.read_text().count("POST /inference/v1/generate") - generated == 8
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        # the session's server serves the tiny model's own weights to the tests after this one
        runtime = build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="vllm",
                                              base_urls=[vllm_server.url]))
        asyncio.run(runtime.load_weights(tiny_model_path, 0))
    storage = RunStorage(config.storage, config.name)
    for step in (1, 2):
        metrics = storage.read_json(storage.step_path(step, "metrics.json"))
        assert metrics["rollouts/verifiers/traces"] == 4 and metrics["rollouts/verifiers/errors"] == 0
        assert metrics["train/mismatch/mean_abs_logprob_diff"] <= 1e-4
    traces = read_traces(storage, 1)
    assert len({t.group_id for t in traces}) == 2 and {t.agent for t in traces} == {"agent"}
    for trace in traces:
        assert set(trace.rewards) == {"correct"} and trace.reward == trace.rewards["correct"]
        assert [m.role for m in trace.messages] == ["user", "assistant"]
        (branch,) = trace.branches
        sampled = np.flatnonzero(branch.sampled)
        # the branch is the prompt, then the completion the server sampled: one run of sampled tokens, last
        assert 0 < len(sampled) <= 8 and sampled[-1] == len(branch) - 1
        assert np.array_equal(sampled, np.arange(sampled[0], len(branch)))
        expected = recomputed_logprobs(tiny_model_path, branch.token_ids, branch.temperature)[branch.sampled]
        assert np.abs(expected - branch.logprobs[branch.sampled]).mean() <= 1e-4


def test_a_verifiers_env_server_that_is_not_there_is_refused_in_one_line(tmp_path):
    from trace_rl.runs.preflight import verifiers_server_problems

    address = f"tcp://127.0.0.1:{free_port()}"
    config = validate_config(served_run(tmp_path, "vf-absent", address, "http://127.0.0.1:1"))
    (line,) = verifiers_server_problems(config)  # check_reachable's, before step 1
    assert line == (f"env.0.server = '{address}': no verifiers env server answers there in 5s; start it "
                    "(trace-rl verifiers-env-server) or fix env.0.server")


def test_a_tcp_server_is_refused_off_verifiers_or_without_a_vllm_server(tmp_path):
    def problem(data: dict) -> str:
        with pytest.raises(ConfigError) as caught:
            validate_config(data)
        (line,) = caught.value.problems
        return line

    absent = problem(served_run(tmp_path, "vf-local", "tcp://127.0.0.1:5000", None))
    assert "env.0.server: a verifiers env server samples the actor itself" in absent
    assert "set inference.base_url" in absent and "--enable-scale-out" in absent
    other = served_run(tmp_path, "vf-other", "tcp://127.0.0.1:5000", "http://127.0.0.1:1")
    other["env"] = [{"id": "reverse-text", "server": "tcp://127.0.0.1:5000"}]
    assert "only env id 'verifiers' plays on" in problem(other)
    other["env"][0]["server"] = "ftp://x"
    assert "http:// or https://, a verifiers env server over tcp://HOST:PORT" in problem(other)


def test_the_env_server_command_refuses_an_env_without_a_verifiers_server(tmp_path, capsys):
    from flows.cli import main

    path = tmp_path / "in-process.toml"
    path.write_text(config_to_toml(validate_config(verifiers_run(str(tmp_path), "vf-in-process", "addition_tasks"))))
    assert main(["verifiers-env-server", str(path), "--env", "0"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"error: --env 0: env.0 of {path} is not a verifiers env with a server = \"tcp://HOST:PORT\"; "
                    "name one that is")


def test_the_seats_runtimes_are_the_env_servers_to_have(tmp_path, capsys, monkeypatch):
    from flows.cli import main

    data = served_run(tmp_path, "vf-docker", "tcp://127.0.0.1:5000", "http://127.0.0.1:1")
    data["env"][0]["args"]["agent"] = {"harness": {"id": "null"}, "runtime": {"type": "docker"}}
    path = tmp_path / "docker.toml"
    path.write_text(config_to_toml(validate_config(data)))  # the trainer's machine needs no docker
    monkeypatch.setenv("PATH", "/nonexistent")  # an env server's machine without docker
    assert main(["verifiers-env-server", str(path)]) != 0  # the env server's does
    (line,) = capsys.readouterr().err.splitlines()[-1:]
    assert "harness 'null' runs in the 'docker' runtime" in line and "this machine lacks it" in line
