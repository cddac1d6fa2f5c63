"""The `verifiers` env: verifiers v1 tasksets and envs trained through the run's own sampler, token-exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.flows.conftest import small_config
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_traces

TASKSETS = str(Path(__file__).resolve().parents[2] / "configs" / "verifiers")  # the shipped tasksets


def verifiers_run(storage: str, name: str, taskset: str, **overrides) -> dict:
    return small_config(storage, name, env=[{
        "id": "verifiers", "batch_size": 2, "group_size": 2, "import_paths": [TASKSETS],
        "args": {"taskset": {"id": taskset}}}], **overrides)


def recomputed_logprobs(model_path: str, token_ids: np.ndarray, temperature: float) -> np.ndarray:
    """log_softmax(logits / T) of each token given the ones before it, by transformers (token 0: 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(token_ids[None], dtype=torch.long)).logits[0, :-1].float() / temperature
    out = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(token_ids[1:, None], dtype=torch.long))[:, 0]
    return np.concatenate([[0.0], out.numpy()])


def assert_token_exact(branch, prompts: list[list[int]], replies: list[str], tokenizer, model_path: str) -> None:
    """Each prompt is the branch so far and each scripted reply's ids (+ EOS) follow it, sampled, with the
    logprobs transformers recomputes."""
    for prompt, reply in zip(prompts, replies):
        reply_ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert np.array_equal(branch.token_ids[:len(prompt) + len(reply_ids)], prompt + reply_ids)
        assert branch.sampled[len(prompt):len(prompt) + len(reply_ids)].all()
    expected = recomputed_logprobs(model_path, branch.token_ids, branch.temperature)[branch.sampled]
    assert np.abs(expected - branch.logprobs[branch.sampled]).mean() <= 1e-4


def test_a_single_turn_taskset_trains_two_steps_and_evaluates(prefect_api, tmp_path):
    import pyarrow.parquet as pq

    from flows.train import run_training

    data = verifiers_run(str(tmp_path), "vf-single", "addition_tasks")
    data["eval"] = {"envs": data["env"], "num_examples": 2, "k": 2}
    config = validate_config(data)
    run_training(config)
    storage = RunStorage(config.storage, config.name)
    for step in (1, 2):
        metrics = storage.read_json(storage.step_path(step, "metrics.json"))
        assert metrics["rollouts/verifiers/traces"] == 4 and metrics["rollouts/verifiers/errors"] == 0
        assert metrics["train/mismatch/mean_abs_logprob_diff"] <= 1e-4
        traces = read_traces(storage, step)
        assert {t.agent for t in traces} == {"agent"} and len({t.group_id for t in traces}) == 2
        for trace in traces:
            assert set(trace.rewards) == {"correct"} and trace.reward == trace.rewards["correct"]
            (branch,) = trace.branches
            assert 0 < branch.sampled.sum() <= 8 and branch.sampled[-1]  # one turn, sampled last
            assert trace.messages[-1].role == "assistant"
    samples = pq.read_table(storage.path("eval", "step_000002", "samples.parquet")).to_pylist()
    assert len(samples) == 4 and not any(sample["error"] for sample in samples)


def test_a_multi_turn_env_splices_the_first_turn_and_matches_recomputed_logprobs(prefect_api, tmp_path,
                                                                                   tiny_model_path):
    from transformers import AutoTokenizer

    from flows.train import run_training

    config = validate_config(verifiers_run(str(tmp_path), "vf-multi", "follow_up_tasks"))
    run_training(config)
    storage = RunStorage(config.storage, config.name)
    for step in (1, 2):
        assert storage.read_json(storage.step_path(step, "metrics.json"))["train/mismatch/mean_abs_logprob_diff"] \
            <= 1e-4
    traces = read_traces(storage, 1)
    assert len(traces) == 4
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for trace in traces:
        assert [m.role for m in trace.messages] == ["user", "assistant", "user", "assistant"]
        assert trace.messages[2].content == "Now add 1 to that."
        (branch,) = trace.branches  # turn 2 extends turn 1's exact ids: one branch
        turns = np.flatnonzero(np.diff(np.concatenate([[0], branch.sampled.astype(int)])) == 1)
        assert len(turns) == 2
        first = branch.token_ids[turns[0]:turns[0] + np.argmin(branch.sampled[turns[0]:])]  # turn 1 as sampled
        first = first[:-1] if first[-1] == tokenizer.eos_token_id else first  # its end of turn ends the message
        assert tokenizer.decode(first, skip_special_tokens=False) == trace.messages[1].content
        expected = recomputed_logprobs(tiny_model_path, branch.token_ids, branch.temperature)[branch.sampled]
        assert np.abs(expected - branch.logprobs[branch.sampled]).mean() <= 1e-4


def test_bad_verifiers_args_are_refused_in_one_line(tmp_path, monkeypatch):
    from trace_rl.config import ConfigError

    def problem(args: dict, **env) -> str:
        data = verifiers_run(str(tmp_path), "vf-bad", "addition_tasks")
        data["env"][0].update(args=args, **env)
        with pytest.raises(ConfigError) as caught:
            validate_config(data)
        (line,) = caught.value.problems
        assert "\n" not in line
        return line

    assert "args.taskset.id = 'no_such_tasks'" in problem({"taskset": {"id": "no_such_tasks"}})
    assert "args.max_concurrent_agents" in problem({"taskset": {"id": "addition_tasks"}, "max_concurrent_agents": 0})
    assert "verifiers' EnvConfig" in problem({"taskset": {"id": "addition_tasks"}, "max_concurrent_agents": 0})
    with monkeypatch.context() as without_docker:
        without_docker.setenv("PATH", "/nonexistent")
        lacking = problem({"taskset": {"id": "addition_tasks"},
                           "agent": {"harness": {"id": "null"}, "runtime": {"type": "docker"}}})
    assert "'docker' runtime" in lacking and "this machine lacks it" in lacking
    assert "import_paths: 'no/such/folder'" in problem({"taskset": {"id": "addition_tasks"}},
                                                         import_paths=["no/such/folder"])


def test_a_failed_episode_is_a_failed_rollout_with_verifiers_error(tiny_model_path):
    import asyncio

    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Sampler
    from trace_rl.envs.lookup import load_env
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig
    from trace_rl.pipeline.rollouts import run_rollout

    env = load_env("verifiers", {"taskset": {"id": "failing_tasks"}},
                   [str(Path(__file__).parent / "verifiers_tasksets")])
    runtime = build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf"))
    sampler = Sampler(runtime, SamplingConfig(max_completion_tokens=4), seed=1)
    examples = env.examples(0, 4)

    async def play():
        return await asyncio.gather(*(run_rollout(env, example, sampler, max_retries=0, backoff_s=0)
                                      for example in examples))

    for example, (traces, retries) in zip(examples, asyncio.run(play())):
        (trace,) = traces
        if example.data["task"] % 2:
            assert trace.error.startswith(f"EnvError: verifiers episode of task {example.id} failed: TaskError")
            assert f"task {example.data['task']} cannot be scored" in trace.error
        else:
            assert trace.error is None and trace.reward == 1.0 and trace.branches[0].sampled.any()


def test_an_image_in_a_message_fails_the_rollout_loop_in_one_line(tiny_model_path):
    """A message the config check did not see (the check reads the task prompts) that carries an image ends the
    rollout with the refusal itself, a FatalError, which fails the step: not a failed rollout, not retried."""
    import asyncio

    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Sampler
    from trace_rl.envs.lookup import load_env
    from trace_rl.errors import FatalError
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig
    from trace_rl.pipeline.rollouts import run_rollout
    from trace_rl.verifiers.client import ImagesRefused

    env = load_env("verifiers", {"taskset": {"id": "image_tasks"}}, [str(Path(__file__).parent / "verifiers_tasksets")])
    runtime = build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf"))
    sampler = Sampler(runtime, SamplingConfig(max_completion_tokens=4), seed=1)
    with pytest.raises(ImagesRefused) as refused:
        asyncio.run(run_rollout(env, env.examples(0, 1)[0], sampler, max_retries=3, backoff_s=0))
    assert isinstance(refused.value, FatalError) and str(refused.value) == (
        "env 'verifiers': a user message carries an image, and trace-rl trains text-only models (the image would be "
        "dropped unseen); use a taskset whose messages are text")


@pytest.mark.vllm
def test_a_multi_turn_episode_on_a_vllm_server_matches_recomputed_logprobs(vllm_server, tiny_model_path):
    import asyncio

    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Sampler
    from trace_rl.envs.lookup import load_env
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig

    env = load_env("verifiers", {"taskset": {"id": "follow_up_tasks"}}, [TASKSETS])
    runtime = build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="vllm",
                                          base_urls=[vllm_server.url]))
    sampler = Sampler(runtime, SamplingConfig(max_completion_tokens=6), seed=5)
    (trace,) = asyncio.run(env.rollout(env.examples(0, 1)[0], sampler))
    (branch,) = trace.branches
    assert [m.role for m in trace.messages] == ["user", "assistant", "user", "assistant"]
    expected = recomputed_logprobs(tiny_model_path, branch.token_ids, branch.temperature)[branch.sampled]
    assert np.abs(expected - branch.logprobs[branch.sampled]).mean() <= 1e-4


def test_verifiers_own_harnesses_find_uv_beside_python_or_are_refused_with_the_fix(tmp_path, monkeypatch):
    import os
    import sys

    from trace_rl.envs.verifiers_env import runtime_lack

    bin_dir = tmp_path / "venv-bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    assert runtime_lack("subprocess", own_harness=True) is None  # trace-rl-chat needs nothing
    assert "`pip install uv` into this Python's environment, as `make setup` does" in runtime_lack("subprocess", False)
    uv = bin_dir / "uv"
    uv.write_text("#!/bin/sh\n")
    uv.chmod(0o755)
    assert runtime_lack("subprocess", False) is None
    assert os.environ["PATH"].split(os.pathsep)[0] == str(bin_dir)  # verifiers' subprocesses find it there
