"""Partial rollouts (`[async] partial_rollout_tokens`) on the transformers sampler and the tiny model: a rollout cut
and continued under newer weights (single-turn, multi-turn, two agents, a verifiers env), the step's choice of ended
groups and its in-flight store, stale tokens masked or dropped, and the configs refused (through the CLI). The
SIGKILL + resume of a run with rollouts in flight: tests/flows/test_partial_runs.py
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from tests.data.test_trace import make_branch, make_trace
from tests.flows.conftest import small_config
from tests.inference.conftest import save_updated_model, trainer_logprobs
from trace_rl.config import AsyncConfig, Config
from trace_rl.data.sample import TrainingSample
from trace_rl.data.trace import Message
from trace_rl.envs.base import Environment, Example
from trace_rl.envs.lookup import load_env
from trace_rl.envs.reverse_text import ReverseText
from trace_rl.inference.build import build_runtime
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.pipeline.partial import (
    InFlightError,
    Rollout,
    SegmentCut,
    SegmentSampler,
    play_partial_rollouts,
    read_in_flight,
    record_versions,
)
from trace_rl.pipeline.rollouts import run_rollout
from trace_rl.pipeline.token_age import age_metrics, drop_stale, mask_stale
from trace_rl.storage import RunStorage

VERIFIERS_TASKSETS = str(Path(__file__).resolve().parents[2] / "configs" / "verifiers")  # the shipped tasksets
# several common bytes end a turn, so rollouts end at different lengths and some stay in flight across steps
STOP_TOKENS = ["<|im_end|>", *"etaoinshr"]


def partial_config(storage: str, name: str, **overrides) -> Config:
    data = small_config(storage, name, **{"async": {"max_off_policy_steps": 1, "partial_rollout_tokens": 3},
                                          "sampling": {"max_completion_tokens": 9}, **overrides})
    return Config(**data)


@pytest.fixture(scope="module")
def runtime(tiny_model_path):
    return build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf"))


@pytest.fixture(scope="module")
def stop_runtime(tiny_model_path):
    return build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="hf", stop_tokens=STOP_TOKENS))


@pytest.fixture(scope="module")
def updated_dir(tiny_model_path, tmp_path_factory) -> str:
    """Weights version 1: the tiny model moved by seeded noise (a stand-in for a trainer step)."""
    path = str(tmp_path_factory.mktemp("weights-1"))
    save_updated_model(tiny_model_path, path)
    return path


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def sampler_runtime(request, runtime):
    """Each in-process sampler in turn (the vLLM one is the session's shared engine)."""
    return runtime if request.param == "hf" else request.getfixturevalue("vllm_runtime")


def test_a_cut_rollout_continues_from_its_exact_ids_and_each_logprob_is_its_own_weights(
        sampler_runtime, tiny_model_path, updated_dir, tmp_path):
    runtime = sampler_runtime
    config = partial_config(str(tmp_path), "cut", sampling={"max_completion_tokens": 10, "temperature": 1.3})
    env = ReverseText()
    example = env.examples(0, 1)[0]
    record = Rollout(origin=1, env_index=0, example_index=0, rollout=0)

    def drive():
        return asyncio.run(env.rollout(example, SegmentSampler(runtime, config, 0, record, seed=11, tokens=4)))

    with pytest.raises(SegmentCut):
        drive()
    (call,) = record.calls
    cut = list(call.token_ids)
    assert len(cut) == 4 and call.versions == [0] * 4 and call.finish_reason is None
    asyncio.run(runtime.load_weights(updated_dir, 1))
    try:
        with pytest.raises(SegmentCut):
            drive()
        assert call.token_ids[:4] == cut and len(call.token_ids) == 8
        (trace,) = drive()  # the last 2 tokens of the 10 allowed, still under version 1
    finally:
        asyncio.run(runtime.load_weights(tiny_model_path, 0))
    assert record.calls == [call] and call.versions == [0] * 4 + [1] * 6
    assert call.finish_reason == ("stop" if call.token_ids[-1] in runtime.stop_token_ids else "length")
    branch = trace.branches[0]
    assert branch.token_ids[branch.sampled].tolist() == call.token_ids  # the env got the ids, not a re-rendering
    np.testing.assert_array_equal(branch.logprobs[branch.sampled], np.float32(call.logprobs))
    versions = np.array(call.versions)
    for version, weights in ((0, tiny_model_path), (1, updated_dir)):
        expected = trainer_logprobs(weights, branch.token_ids.tolist(), 1.3)[branch.sampled][versions == version]
        np.testing.assert_allclose(branch.logprobs[branch.sampled][versions == version], expected, atol=2e-5, rtol=0)
    other = trainer_logprobs(updated_dir, branch.token_ids.tolist(), 1.3)[branch.sampled][versions == 0]
    assert np.abs(other - branch.logprobs[branch.sampled][versions == 0]).max() > 1e-3  # the versions differ


def drive_in_segments(env, example, runtime, config: Config, weights: list[str], tokens: int):
    """Drive one rollout of `env` a segment of `tokens` at a time, under weights versions 0, 1, 0, ... (`weights`),
    until it ends; check that each drive continued the calls of the one before from their exact ids, sampling at
    most `tokens` over them. Its record, its traces (their per-token versions recorded) and how many drives."""
    record = Rollout(origin=1, env_index=0, example_index=0, rollout=0)
    drives = 0
    try:
        while True:
            version = drives % len(weights)
            asyncio.run(runtime.load_weights(weights[version], version))
            before = [list(call.token_ids) for call in record.calls]
            sampler = SegmentSampler(runtime, config, 0, record, seed=11, tokens=tokens)
            try:
                traces, _ = asyncio.run(run_rollout(env, example, sampler, max_retries=0, backoff_s=0))
            except SegmentCut:
                traces = None
            drives += 1
            after = [call.token_ids for call in record.calls]
            assert len(after) >= len(before) and all(a[:len(b)] == b for a, b in zip(after, before))
            assert 0 < sum(map(len, after)) - sum(map(len, before)) <= tokens
            if traces is not None:
                break
    finally:
        asyncio.run(runtime.load_weights(weights[0], 0))
    assert [t.error for t in traces] == [None] * len(traces)
    record_versions(traces, record, env.id)
    return record, traces, drives


@pytest.mark.parametrize("env_id, args", [
    ("alphabet-sort", {"turns": 3}),  # one agent, three turns
    ("number-debate", {"rounds": 2}),  # two agents in turn, two turns each
    ("verifiers", {"taskset": {"id": "follow_up_tasks"}}),  # a verifiers env, two turns, on its interception server
])
def test_a_multi_turn_rollout_continues_between_and_within_turns_each_logprob_its_own_weights(
        runtime, tiny_model_path, updated_dir, tmp_path, env_id, args):
    config = partial_config(str(tmp_path), "turns", sampling={"max_completion_tokens": 6, "temperature": 1.3})
    env = load_env(env_id, args, [VERIFIERS_TASKSETS])
    example = env.examples(0, 1)[0]
    record, traces, drives = drive_in_segments(env, example, runtime, config, [tiny_model_path, updated_dir], 4)
    turns = {"alphabet-sort": 3, "number-debate": 4, "verifiers": 2}[env_id]
    assert len(record.calls) == turns and all(call.finish_reason for call in record.calls)
    assert drives == -(-sum(len(call.token_ids) for call in record.calls) // 4)  # every drive sampled its 4 tokens
    runs = 0
    for trace in traces:
        for branch in trace.branches:
            sampled = branch.sampled
            versions = branch.policy_versions
            assert ((versions >= 0) == sampled).all()
            runs += int(np.sum(np.diff(np.concatenate([[0], sampled.astype(int)])) == 1))
            for version, weights in enumerate((tiny_model_path, updated_dir)):
                mine = versions[sampled] == version
                expected = trainer_logprobs(weights, branch.token_ids.tolist(), 1.3)[sampled][mine]
                np.testing.assert_allclose(branch.logprobs[sampled][mine], expected, atol=2e-5, rtol=0)
    assert runs == turns  # each call's completion is one run of sampled tokens, its versions recorded
    spanning = [call for call in record.calls if len(set(call.versions)) == 2]
    assert spanning, "no call was continued under other weights: change the budget or the seed"


class CountingEnv(Environment):
    """An env whose prompt says how often it was played: not a function of its example and sampled tokens."""

    def __init__(self):
        super().__init__()
        self.plays = 0

    async def rollout(self, example, sampler):
        self.plays += 1
        conversation = sampler.conversation([Message(role="user", content=f"Play {self.plays}.")])
        await conversation.sample()
        return [self.trace(example, conversation)]


def test_a_drive_that_renders_another_prompt_for_a_recorded_call_fails_its_rollout(runtime, tmp_path):
    config = partial_config(str(tmp_path), "drift", sampling={"max_completion_tokens": 10})
    env, record = CountingEnv(), Rollout(origin=1, env_index=0, example_index=0, rollout=0)
    example = Example(id="e")
    with pytest.raises(SegmentCut):
        asyncio.run(run_rollout(env, example, SegmentSampler(runtime, config, 0, record, seed=1, tokens=3),
                                max_retries=0, backoff_s=0))
    (trace,), _ = asyncio.run(run_rollout(env, example, SegmentSampler(runtime, config, 0, record, seed=1, tokens=3),
                                          max_retries=0, backoff_s=0))
    assert trace.error.startswith("EnvError: generate call 1 of the rollout rendered another prompt than when it was "
                                  "sampled")
    assert len(record.calls[0].token_ids) == 3  # nothing sampled for another episode


def run_steps(config: Config, runtime, storage: RunStorage, steps, updated_dir: str, tiny_model_path: str) -> dict:
    """play_partial_rollouts for each step, the runtime on weights v(step) (1 from step 3: the updated ones)."""
    out = {}
    for step in steps:
        version = 1 if step >= 3 else 0
        asyncio.run(runtime.load_weights(updated_dir if version else tiny_model_path, version))
        out[step] = asyncio.run(play_partial_rollouts(config, {"policy": runtime}, step, storage))
    asyncio.run(runtime.load_weights(tiny_model_path, 0))
    return out


@pytest.mark.parametrize("env, agents", [
    ({"id": "reverse-text"}, 1),
    ({"id": "number-debate", "args": {"rounds": 1}}, 2),  # two agents, a turn each: continued between turns too
])
def test_each_step_trains_batch_size_ended_groups_oldest_first_and_continues_the_rest(
        stop_runtime, updated_dir, tiny_model_path, tmp_path, env, agents):
    config = partial_config(str(tmp_path), "steps", model={"name": tiny_model_path, "stop_tokens": STOP_TOKENS},
                            env=[{**env, "batch_size": 2, "group_size": 4}])
    storage = RunStorage(config.storage, config.name)
    steps = run_steps(config, stop_runtime, storage, (1, 2, 3, 4), updated_dir, tiny_model_path)
    for step, (traces, summary) in steps.items():
        groups = list(dict.fromkeys(t.group_id for t in traces))
        assert len(groups) == 2 and len(traces) == 8 * agents, step  # batch_size groups of group_size, whole
        origins = [int(g.split("-")[0][4:]) for g in groups]
        assert origins == sorted(origins) and max(origins) <= step + 1
        assert summary.in_flight == 16 - 8  # two steps of groups in the pool, one step's trained
        for trace in traces:
            (branch,) = trace.branches
            assert trace.policy_step == branch.policy_versions.max()
            assert (branch.policy_versions[branch.sampled] <= (1 if step >= 3 else 0)).all()
    continued = [t for traces, _ in steps.values() for t in traces
                 if len(set(t.branches[0].policy_versions[t.branches[0].sampled].tolist())) == 2]
    assert continued, "no rollout was continued under newer weights: change the stop tokens or the seed"
    assert sum(summary.carried_tokens for _, summary in steps.values()) > 0
    # a step sampled again from the stored rollouts of the step before (a resume) samples the same traces
    again = run_steps(config, stop_runtime, storage, (3, 4), updated_dir, tiny_model_path)
    for step in (3, 4):
        assert len(again[step][0]) == len(steps[step][0])
        assert all(a.equals(b) for a, b in zip(again[step][0], steps[step][0]))
        assert again[step][1] == steps[step][1]


def test_a_missing_or_truncated_in_flight_store_is_refused_in_one_line(tmp_path):
    storage = RunStorage(str(tmp_path), "run")
    with pytest.raises(InFlightError, match=r"in_flight.json is missing: step 3 continues .*; restore it"):
        read_in_flight(storage, 2)
    storage.write_atomic(storage.step_path(2, "in_flight.json"), b'{"step": 2, "rollouts": [{"ori')
    with pytest.raises(InFlightError) as refused:
        read_in_flight(storage, 2)
    assert "\n" not in str(refused.value) and "is not an in-flight store" in str(refused.value)
    assert read_in_flight(storage, 0) == []


def aged_trace(trace_id: str, versions: list[int]):
    branch = make_branch(n=3 + len(versions))
    branch.policy_versions = np.array([-1, -1, -1, *versions], np.int32)
    return make_trace(trace_id, branches=[branch], policy_step=max(versions))


def test_tokens_older_than_max_token_age_are_masked_or_their_rollout_dropped():
    # step 6 trains from weights 5; with max_token_age 2 tokens of weights 3 and newer train, older ones are stale
    fresh, carried, stale = aged_trace("fresh", [4, 4]), aged_trace("carried", [3, 4]), aged_trace("stale", [2, 3])
    # ages 6 - 1 - v: 1, 1 | 2, 1 | 3, 2
    assert age_metrics([fresh, carried, stale], 6) == {"async/token_age_mean": 10 / 6, "async/token_age_max": 3.0}
    samples = [
        TrainingSample(trace_id=t.id, branch_index=0, env="e", input_ids=b.token_ids, temperature=1.0,
                       sampled=b.sampled, inference_logprobs=b.logprobs, rl_values=np.ones(len(b), np.float32),
                       rl_mask=b.sampled, ce_values=np.zeros(len(b), np.float32), ce_mask=np.zeros(len(b), bool),
                       policy_versions=b.policy_versions)
        for t in (fresh, carried, stale) for b in t.branches
    ]
    channel_mask = samples[2].rl_mask
    assert mask_stale(samples, 6, 2) == 1
    assert [s.rl_mask[3:].tolist() for s in samples] == [[True, True], [True, True], [False, True]]
    assert channel_mask.tolist() == [False, False, False, True, True]  # the channel's own array is left as it was
    assert drop_stale([[fresh], [carried], [stale]], 6, 2) == 1
    assert [t.error is None for t in (fresh, carried, stale)] == [True, True, False]
    assert stale.error.startswith("dropped for age")
    assert mask_stale(samples, 6, 3) == 0  # max_token_age 3: weights 2 and newer train

    def bound(k: int, age: int | None = None, completions: tuple[int, ...] = (6, 9)) -> int:
        envs = [{"id": "reverse-text", "sampling": {"max_completion_tokens": c}} for c in completions]
        return Config(name="bound", env=envs, **{"async": AsyncConfig(
            max_off_policy_steps=k, partial_rollout_tokens=4, max_token_age=age)}).token_age_bound

    # unset: k + the segments the longest completion can need (9 tokens in segments of 4: 3)
    assert [bound(1), bound(3), bound(0), bound(0, completions=(4,)), bound(0, 2), bound(1, 1)] == [4, 6, 3, 1, 2, 1]


class SandboxEnv(ReverseText):
    """An env whose rollouts have effects outside it: driving one again would repeat them."""

    drivable_again = False


@pytest.mark.parametrize("change, problem", [
    ({"async": {"max_off_policy_steps": 1, "partial_rollout_tokens": 0}},
     "async.partial_rollout_tokens: Input should be greater than or equal to 1"),
    ({"async": {"partial_rollout_tokens": 4, "max_token_age": 0}},
     "async.max_token_age = 0 would mask every token an earlier step sampled: set async.max_token_age >= 1"),
    ({"async": {"max_token_age": 2}}, "async.max_token_age bounds the age of tokens continued across steps"),
    ({"async": {"max_off_policy_steps": 2, "partial_rollout_tokens": 4, "max_token_age": 1}},
     ("async.max_token_age = 1 would mask every token: the schedule samples tokens max_off_policy_steps = 2 steps "
      "old; set max_token_age >= 2")),
    ({"async": {"max_off_policy_steps": 1, "partial_rollout_tokens": 4},
      "env": [{"id": "tests.pipeline.test_partial:SandboxEnv", "batch_size": 2, "group_size": 2}]},
     ("env.0: async.partial_rollout_tokens continues a rollout by driving its env again with the tokens it sampled, "
      "which env 'tests.pipeline.test_partial:SandboxEnv' cannot be (SandboxEnv sets drivable_again = False)")),
    ({"async": {"max_off_policy_steps": 1, "partial_rollout_tokens": 4},
      "env": [{"id": "verifiers", "batch_size": 2, "group_size": 2, "args": {"taskset": {"id": "sandboxed_tasks"}},
               "import_paths": [str(Path(__file__).resolve().parents[1] / "envs" / "verifiers_tasksets")]}]},
     "which env 'verifiers' cannot be (taskset SandboxedTaskset sets drivable_again = False)"),
    ({"async": {"max_off_policy_steps": 1, "partial_rollout_tokens": 4}, "sampling": {"stop": ["\n"]}},
     "env.0 sampling.stop: a stop string may span a cut"),
    ({"async": {"max_off_policy_steps": 1, "partial_rollout_tokens": 4},
      "inference": {"backend": "vllm", "base_url": "http://127.0.0.1:9"},
      "env": [{"id": "verifiers", "server": "tcp://127.0.0.1:9", "batch_size": 2, "group_size": 2}]},
     "env.0.server: async.partial_rollout_tokens does not continue episodes a verifiers env server plays"),
])
def test_partial_rollouts_it_cannot_continue_are_refused_in_one_line_by_the_cli(tmp_path, capsys, change, problem):
    from flows.cli import main

    config = tmp_path / "refused.toml"
    config.write_text(tomli_w.dumps(small_config(str(tmp_path), "refused", **change)))
    assert main(["train", str(config), "--dry-run"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert any(problem in line for line in lines) and all(line.startswith("error: ") for line in lines), lines


def test_partial_rollout_tokens_alone_passes_the_check_with_its_derived_age_bound(tmp_path):
    from flows.cli import main

    config = tmp_path / "partial.toml"
    config.write_text(tomli_w.dumps(small_config(str(tmp_path), "partial", **{"async": {"partial_rollout_tokens": 4}})))
    assert main(["train", str(config), "--dry-run"]) == 0
    loaded = Config(**small_config(str(tmp_path), "partial", **{"async": {"partial_rollout_tokens": 4}}))
    assert loaded.token_age_bound == loaded.max_segments > 1  # k = 0, and a completion longer than a segment
