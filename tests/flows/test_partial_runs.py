"""Partial rollouts (`[async] partial_rollout_tokens`) in whole runs on the hf sampler and the tiny model: one run
composes them with two envs, LoRA, prefix-shared training, eval and replay; the same config, SIGKILLed at every
stage of a step with rollouts in flight and resumed each time, ends bitwise equal to it. Cutting and continuing one
rollout, the step's choice of groups and the refusals: tests/pipeline/test_partial.py; env-owned algorithms on an env
server: tests/remote/test_remote_step.py."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.bitwise import difference
from tests.flows.test_crash_resume import STEPS, finish, output, start, train_here, write_config
from trace_rl.pipeline.partial import read_in_flight
from trace_rl.pipeline.schedule import sampling_weights
from trace_rl.pipeline.token_age import oldest_version
from trace_rl.storage import RunStorage, step_name
from trace_rl.tables import read_batch, read_table, read_traces, table_to_traces

SEGMENT = 3
ENVS = [{"id": "reverse-text", "batch_size": 2, "group_size": 4},
        {"id": "reverse-text", "batch_size": 1, "group_size": 3, "args": {"min_length": 6, "max_length": 9}}]
NAMES = ["reverse-text#0", "reverse-text#1"]
COMPOSED = {
    # several common bytes end a turn, so rollouts end at different lengths and some stay in flight across steps
    "async": {"max_off_policy_steps": 1, "partial_rollout_tokens": SEGMENT},
    "model": {"name": "tiny", "stop_tokens": ["<|im_end|>", *"etaoinshr"], "lora": {"rank": 4}},
    "trainer": {"lr": 1e-3, "micro_batch_tokens": 1024, "share_prefixes": True},
    "sampling": {"max_completion_tokens": 9},
    "env": ENVS,
    "eval": {"k": 2, "num_examples": 2, "envs": [{"id": "reverse-text"}]},
}


@pytest.fixture(scope="module")
def composed(prefect_api, tmp_path_factory) -> tuple[Path, RunStorage]:
    """The uninterrupted run, trained in this process: (its folder, its storage)."""
    folder = tmp_path_factory.mktemp("partial")
    train_here(write_config(folder, "composed", **COMPOSED))
    return folder, RunStorage(str(folder / "runs"), "composed")


def sampled_versions(branch) -> list[int]:
    return branch.policy_versions[branch.sampled].tolist()


def test_partial_rollouts_compose_with_two_envs_lora_prefix_sharing_eval_and_replay(composed, tmp_path):
    _, storage = composed
    carried = 0
    for step in range(1, STEPS + 1):
        traces = {t.id: t for t in read_traces(storage, step)}
        batch = read_batch(storage, step)
        for env, name in zip(ENVS, NAMES):  # exactly batch_size whole groups of each env, every one ended
            groups: dict[str, int] = {}
            for group in (traces[s.trace_id].group_id for s in batch):
                if f"-{name}-" in group:  # step<origin>-<env name>-<example>
                    groups[group] = groups.get(group, 0) + 1
            assert sorted(groups.values()) == [env["group_size"]] * env["batch_size"], (step, name, groups)
        assert len(batch) == len(traces) == 11 and all(t.error is None for t in traces.values())
        for sample in batch:  # the batch's versions are the trace's, within what max_off_policy_steps allows
            versions = sample.policy_versions[sample.sampled]
            assert versions.tolist() == sampled_versions(traces[sample.trace_id].branches[0])
            assert oldest_version(step, 2) <= versions.min() and versions.max() <= sampling_weights(step, 1)
            carried += len(set(versions.tolist())) > 1
        for table in ("traces.parquet", "batch.parquet"):
            assert "policy_versions" in pq.read_schema(storage.step_path(step, table)).names
        metrics = storage.read_json(storage.step_path(step, "metrics.json"))
        assert metrics["partial/in_flight"] > 0 and metrics["train/tokens"] < metrics["train/sample_tokens"]  # shared
    assert carried, "no trained rollout was continued under newer weights: change the stop tokens or the seed"
    weights = Path(storage.path("weights", step_name(STEPS)))
    assert (weights / "adapter_model.safetensors").exists() and not (weights / "model.safetensors").exists()

    # eval samples every completion to its end in one go, under the weights it evaluates
    evaluated = table_to_traces(read_table(storage, storage.path("eval", f"step_{STEPS:06d}", "traces.parquet")))
    assert evaluated and all(set(sampled_versions(b)) == {STEPS} for t in evaluated for b in t.branches)
    assert max(int(b.sampled.sum()) for t in evaluated for b in t.branches) > SEGMENT

    from flows.replay import replay_flow
    from trace_rl.algorithms.base import AlgorithmConfig

    replay_flow(run=storage.url, algorithms=[AlgorithmConfig(id="grpo")], out=f"{tmp_path}/replayed")
    replayed = RunStorage.from_url(f"{tmp_path}/replayed")
    for step in range(1, STEPS + 1):  # the replay of a run with partial rollouts reproduces its batches
        assert pq.read_table(replayed.step_path(step, "batch.parquet")).equals(
            pq.read_table(storage.step_path(step, "batch.parquet")))


def test_without_overlap_each_step_samples_its_segments_with_the_weights_it_trains_from(prefect_api, tmp_path):
    """`max_off_policy_steps = 0`: each step samples its segments with the weights of the step before it, before it
    trains, and nothing beside training; the tokens a rollout carries from an earlier step train (they are 1 step
    old, within `max_token_age = 1`), older ones would be masked."""
    config = write_config(tmp_path, "no-overlap", **{
        **{key: value for key, value in COMPOSED.items() if key != "eval"}, "env": ENVS[:1],
        "async": {"max_off_policy_steps": 0, "partial_rollout_tokens": SEGMENT, "max_token_age": 1},
        "model": {key: value for key, value in COMPOSED["model"].items() if key != "lora"}})
    train_here(config)
    storage = RunStorage(str(tmp_path / "runs"), "no-overlap")
    carried = 0
    for step in range(1, STEPS + 1):
        traces = {t.id: t for t in read_traces(storage, step)}
        batch = read_batch(storage, step)
        metrics = storage.read_json(storage.step_path(step, "metrics.json"))
        assert "time/wait_for_sampling" not in metrics and metrics["time/sample_rollouts"] > 0  # sampled in the step
        masked, newest = 0, []
        for sample in batch:
            versions = sample.policy_versions
            assert versions[sample.sampled].tolist() == sampled_versions(traces[sample.trace_id].branches[0])
            newest.append(int(versions[sample.sampled].max()))
            masked += int((sample.sampled & (versions < step - 2)).sum())  # age = step - 1 - v > 1
            carried += int((sample.rl_mask & (versions == step - 2)).sum())  # age 1: trained
        assert metrics["batch/age_masked_tokens"] == masked
        # this step's segments (in the traces it trained or the rollouts it left in flight): sampled with the
        # weights it trains from, none newer
        newest += [v for record in read_in_flight(storage, step) for call in record.calls for v in call.versions]
        assert max(newest) == step - 1
    assert carried, "no trained rollout was carried over from an earlier step: change the stop tokens or the seed"


# every stage of step 2, whose rollouts continue those step 1 left in flight, in the order the run passes them
# (tests/flows/kill_at.py); the sampling of step 2 runs beside the training of step 1, that of step 3 beside step 2's
KILL_POINTS = ["sample", "in_flight", "algorithm", "validate", "aggregate", "write_batch", "train", "checkpoint"]


@pytest.mark.slow
def test_a_run_with_partial_rollouts_killed_at_every_stage_of_a_step_resumes_bitwise_identical(composed):
    folder, expected = composed
    config = write_config(folder, "killed", **COMPOSED)
    storage = RunStorage(str(folder / "runs"), "killed")
    flags: tuple[str, ...] = ()
    for point in KILL_POINTS:
        process = start(config, *flags, kill_at=(point, 2))
        assert process.wait(timeout=600) == -signal.SIGKILL, f"{point}: {output(process)[-3000:]}"
        flags = ("--resume",)
        if point == "in_flight":  # a resume that finds the store of step 1 missing trains nothing
            store = Path(storage.step_path(1, "in_flight.json"))
            kept = store.read_bytes()
            store.unlink()
            refused = start(config, "--resume")
            assert refused.wait(timeout=600) == 2
            line, = [line for line in output(refused).splitlines() if line.startswith("error: ")]
            assert line.endswith("in_flight.json is missing: step 2 continues the rollouts step 1 left in flight; "
                                 "restore it from a copy of the run, or start the run again (train --overwrite)")
            assert "Traceback" not in output(refused)
            assert not storage.exists(storage.step_path(2, "traces.parquet"))
            store.write_bytes(kept)
    finish(start(config, "--resume"))
    assert storage.stable_steps("weights") == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for table in ("traces.parquet", "batch.parquet", "in_flight.json"):
            why = difference(*(Path(run.step_path(step, table)).read_bytes() for run in (storage, expected)))
            assert why is None, f"step {step}'s {table}: {why}"
    adapter = ("weights", step_name(STEPS), "adapter_model.safetensors")
    assert (why := difference(*(Path(run.path(*adapter)).read_bytes() for run in (storage, expected)))) is None, why
    assert np.array_equal(*(pq.read_table(s.path("eval", f"step_{STEPS:06d}", "samples.parquet"))["reward"]
                            for s in (storage, expected)))
