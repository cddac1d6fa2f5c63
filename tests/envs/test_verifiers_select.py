"""`[[env]] select` (verifiers' SelectConfig), infinite tasksets streamed step by step and across a kill and resume,
what `--dry-run` refuses of a verifiers env, one line each, and a two-seat env on trace-rl's chat harness."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from tests.flows.conftest import small_config
from trace_rl.config import ConfigError
from trace_rl.envs.lookup import load_env
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_traces

ROOT = Path(__file__).resolve().parents[2]
TASKSETS = str(Path(__file__).parent / "verifiers_tasksets")  # the tests' own tasksets


def env_entry(taskset: str, select: dict | None = None, batch_size: int = 2, **args) -> dict:
    entry = {"id": "verifiers", "batch_size": batch_size, "group_size": 2, "import_paths": [TASKSETS],
             "args": {"taskset": {"id": taskset}, **args}}
    return entry if select is None else {**entry, "select": select}


def problem(tmp_path, entry: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_config(small_config(str(tmp_path), "vf-select", env=[entry]))
    (line,) = caught.value.problems
    assert "\n" not in line
    return line


def stream_prompts(start: int, stop: int) -> list[str]:
    """verifiers' own iteration of the counting stream, positions start ... stop - 1."""
    sys.path.insert(0, TASKSETS)
    from counting_stream import CountingConfig, CountingStream

    return [task.data.prompt for task in itertools.islice(CountingStream(CountingConfig()), start, stop)]


def test_select_picks_the_tasks_verifiers_picks():
    import verifiers.v1 as vf

    select = {"include": {"idx": ["0:3"]}, "exclude": {"idx": [1]}, "shuffle": True, "seed": 4}
    env = load_env("verifiers", {"taskset": {"id": "failing_tasks"}}, [TASKSETS], select=select)
    expected = [task.data.idx for task in env.taskset().select(vf.SelectConfig(**select))]
    assert sorted(expected) == [0, 2]
    assert [env.task_at(e).data.idx for e in env.examples_for_step(0, 1, 0, 2)] in (expected, expected[::-1])
    # an infinite taskset bounded by a limit is walked epoch by epoch like a finite one
    bounded = load_env("verifiers", {"taskset": {"id": "counting_stream"}}, [TASKSETS], select={"skip": 5, "limit": 3})
    assert bounded.bounded and [t.data.prompt for t in bounded.tasks] == stream_prompts(5, 8)
    examples = [e for step in (1, 2, 3) for e in bounded.examples_for_step(0, step, 0, 2)]
    assert sorted(e.data["task"] for e in examples[:3]) == [0, 1, 2]  # epoch 0: each task once


def test_an_infinite_taskset_without_select_is_a_stream_by_step():
    env = load_env("verifiers", {"taskset": {"id": "counting_stream"}}, [TASKSETS])
    assert not env.bounded
    for step in (1, 2, 7):
        examples = env.examples_for_step(11, step, 0, 3)
        assert [e.id for e in examples] == [f"task{p}" for p in range(3 * (step - 1), 3 * step)]
        assert [env.task_at(e).data.prompt for e in examples] == stream_prompts(3 * (step - 1), 3 * step)
    again = load_env("verifiers", {"taskset": {"id": "counting_stream"}}, [TASKSETS])
    assert [again.task_at(e).data.prompt for e in again.examples_for_step(99, 7, 0, 3)] == stream_prompts(18, 21)


def test_dry_run_refuses_what_step_1_would_in_one_line(tmp_path):
    shuffled = problem(tmp_path, env_entry("counting_stream", {"shuffle": True, "limit": 4}))
    assert shuffled.startswith("env.0: env 'verifiers': select.shuffle: taskset 'counting_stream' is infinite")
    assert 'select.include = { idx = ["0:1000"] }' in shuffled
    assert "select.limt: Extra inputs are not permitted (verifiers' SelectConfig)" in problem(
        tmp_path, env_entry("counting_stream", {"limt": 4}))
    assert "select.include.idx: Value error, idx -1 is negative" in problem(
        tmp_path, env_entry("counting_stream", {"include": {"idx": [-1]}}))
    nothing = env_entry("failing_tasks", {"include": {"idx": ["9:"]}})
    assert "has no tasks that select picks" in problem(tmp_path, nothing)
    # an infinite taskset whose rows cannot load: its first task is taken, as step 1 takes it
    assert problem(tmp_path, env_entry("unreachable_stream")) == (
        "env.0: env 'verifiers': taskset 'unreachable_stream' cannot load its tasks: ConnectionError: cannot reach "
        "the dataset hub for 'example/unreachable-rows' (offline)")
    assert "env.0: select picks a verifiers taskset's tasks, and env 'reverse-text' is no verifiers env" in problem(
        tmp_path, {"id": "reverse-text", "select": {"limit": 2}})
    # a seat that defaults to verifiers' `null` harness (as kuhn_poker's): the refusal names a fix that works
    duel = problem(tmp_path, env_entry("coin_duel"))
    assert "args.player0: harness 'null' runs in the 'prime' runtime" in duel
    assert 'trace-rl\'s chat harness (args.player0.harness = { id = "trace-rl-chat" })' in duel
    chat = {"harness": {"id": "trace-rl-chat"}}
    validate_config(small_config(str(tmp_path), "vf-duel", env=[env_entry("coin_duel", player0=chat, player1=chat)]))
    # a taskset whose tasks serve MCP tools: trace-rl's chat harness runs them, verifiers' terminus_2 cannot
    validate_config(small_config(str(tmp_path), "vf-tools", env=[env_entry("tool_tasks")]))
    terminus = {"harness": {"id": "terminus_2"}, "runtime": {"type": "subprocess"}}
    assert "env.0: env 'verifiers': args.agent: Harness 'terminus_2' does not support MCP tools" in problem(
        tmp_path, env_entry("tool_tasks", agent=terminus))
    # the CLI: exit 2, the line alone
    config = tmp_path / "shuffled.toml"
    config.write_text(tomli_w.dumps(small_config(str(tmp_path), "vf-cli", env=[
        env_entry("counting_stream", {"shuffle": True})])))
    done = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(config), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and done.stderr.startswith("error: env.0: env 'verifiers': select.shuffle: ")
    assert done.stderr.count("\n") == 1, done.stderr
    # a taskset that shows the model an image (verifiers' vision envs): a text-only model would never see it
    config.write_text(tomli_w.dumps(small_config(str(tmp_path), "vf-images", env=[env_entry("image_tasks")])))
    done = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(config), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2 and done.stderr == (
        "error: env.0: env 'verifiers': taskset 'image_tasks', task 0: a user message carries an image, and trace-rl "
        "trains text-only models (the image would be dropped unseen); use a taskset whose messages are text\n")


def test_seats_that_default_to_a_harness_play_on_the_chat_harness_and_grpo_baselines_each_seat(hf_runtime):
    import asyncio

    import numpy as np

    from trace_rl.algorithms import load_algorithm
    from trace_rl.algorithms.runner import apply_algorithm
    from trace_rl.config import Config
    from trace_rl.pipeline.rollouts import play_rollouts

    chat = {"harness": {"id": "trace-rl-chat"}}  # the fix the refusal names
    config = Config(name="duel", seed=2, sampling={"max_completion_tokens": 6},
                    env=[env_entry("coin_duel", batch_size=1, player0=chat, player1=chat) | {"group_size": 4}])
    traces, summary = asyncio.run(play_rollouts(config, {"policy": hf_runtime}, step=1))
    assert summary.envs["verifiers"].errors == 0 and len(traces) == 8
    payoffs = {seat: [t.reward for t in traces if t.agent == seat] for seat in ("player0", "player1")}
    assert all(sorted(pair) == [-1.0, 1.0] for pair in zip(*payoffs.values()))  # zero-sum, every game
    assert len(set(payoffs["player0"])) == 2  # both seats won a game: a pooled mean would be 0 every time
    channels = {c.trace_id: c for c in asyncio.run(apply_algorithm(load_algorithm("grpo"), traces))}
    for trace in traces:
        channel = channels[trace.id]
        expected = trace.reward - np.mean(payoffs[trace.agent])
        np.testing.assert_allclose(channel.values[channel.mask], expected, atol=1e-6)


@pytest.mark.slow
def test_a_streamed_run_killed_and_resumed_takes_the_next_tasks_each_step(prefect_api, tmp_path):
    config = tmp_path / "stream.toml"
    config.write_text(tomli_w.dumps(small_config(str(tmp_path / "runs"), "stream", steps=2,
                                                 env=[env_entry("counting_stream")])))
    storage = RunStorage(str(tmp_path / "runs"), "stream")
    log = open(tmp_path / "killed.log", "w+")  # noqa: SIM115 - read on failure
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", str(config)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=log, process_group=0)
    deadline = time.monotonic() + 300
    while not storage.exists(storage.step_path(2, "traces.parquet")):  # killed inside step 2
        assert process.poll() is None, log.seek(0) or log.read()[-3000:]
        assert time.monotonic() < deadline, "step 2 never sampled"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not storage.exists(storage.step_path(2, "metrics.json"))
    resumed = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(config), "--resume"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    prompts = stream_prompts(0, 4)
    for step in (1, 2):
        traces = read_traces(storage, step)
        assert len(traces) == 4 and not any(t.error for t in traces)
        positions = [2 * (step - 1), 2 * (step - 1) + 1]
        assert sorted({t.example_id for t in traces}) == [f"task{p}" for p in positions]
        for trace in traces:
            position = int(trace.example_id.removeprefix("task"))
            assert trace.messages[0].content == prompts[position]  # the task verifiers streams there
