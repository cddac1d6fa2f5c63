"""The optional `reasoning-gym` env: seeded procedural tasks scored by the task's own checker."""

from __future__ import annotations

import asyncio

import pytest

from tests.envs.conftest import ScriptedRuntime
from tests.flows.conftest import small_config
from trace_rl.config import ConfigError, SamplingConfig
from trace_rl.envs import Sampler, load_env
from trace_rl.envs.gym import reply_answer
from trace_rl.models.tiny import build_tokenizer
from trace_rl.runs.loading import validate_config

pytest.importorskip("reasoning_gym", reason="the optional reasoning-gym package (pip install 'trace-rl[gym]')")
ARGS = {"task": "basic_arithmetic", "options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def rollout(env, example, reply: str):
    runtime = ScriptedRuntime(build_tokenizer(), [reply])
    sampling = SamplingConfig(temperature=1.0, max_completion_tokens=8)
    return asyncio.run(env.rollout(example, Sampler(runtime, sampling, seed=0)))[0]


def test_examples_follow_the_seed_and_the_tasks_options():
    env = load_env("reasoning-gym", ARGS)
    first = env.examples_for_step(5, 1, 0, 3)
    assert [e.data["question"] for e in first] == [e.data["question"] for e in env.examples_for_step(5, 1, 0, 3)]
    assert [e.data["question"] for e in first] != [e.data["question"] for e in env.examples_for_step(5, 2, 0, 3)]
    assert [e.data["question"] for e in first] != [e.data["question"] for e in env.examples_for_step(6, 1, 0, 3)]
    assert all(sum(c.isdigit() for c in e.data["question"]) == 2 for e in first)  # two one-digit terms


def test_the_tasks_checker_scores_the_answer_tag():
    env = load_env("reasoning-gym", ARGS)
    example = env.examples_for_step(5, 1, 0, 1)[0]
    answer = example.data["answer"]
    right = rollout(env, example, f"step by step... <answer>{answer}</answer>")
    assert right.reward == 1.0 and right.rewards == {"score": 1.0} and right.info["answer"] == answer
    assert right.messages[0].role == "system" and right.messages[1].content == example.data["question"]
    assert rollout(env, example, "<answer>not a number</answer>").reward == 0.0
    assert reply_answer("a <answer> 1 </answer> then <answer>2</answer>") == "2" and reply_answer(" 7 ") == "7"


def test_unknown_task_or_option_is_a_config_error(tmp_path):
    data = small_config(str(tmp_path), "gym")
    for args, message in [({"task": "no_such_task"}, "no_such_task"), ({**ARGS, "options": {"bogus": 1}}, "bogus")]:
        data["env"] = [{"id": "reasoning-gym", "args": args}]
        with pytest.raises(ConfigError, match=f"env.0: reasoning-gym task .*{message}"):
            validate_config(data)
