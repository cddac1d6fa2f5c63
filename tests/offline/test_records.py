"""A run's traces out as verifiers records and back in: `export-traces` writes what `vf.WireTrace` reads with the
same branches, tokens and logprobs, and `replay --traces` of that file through the run's own algorithm writes the
run's own batches, bit for bit; bad input is refused in one line (exit 2)."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

import verifiers.v1 as vf  # the test extra installs it: a missing package fails, never skips

from tests.flows.conftest import small_config  # noqa: E402
from trace_rl.algorithms.base import AlgorithmConfig  # noqa: E402
from trace_rl.runs.loading import validate_config  # noqa: E402
from trace_rl.storage import RunStorage  # noqa: E402
from trace_rl.tables import read_traces  # noqa: E402

STEPS = (1, 2)


@pytest.fixture(scope="module")
def run(prefect_api, tmp_path_factory) -> RunStorage:
    """Two steps of reverse-text on the hf sampler, trained with grpo (the small config's algorithm)."""
    from flows.train import run_training

    config = validate_config(small_config(str(tmp_path_factory.mktemp("runs")), "records", steps=len(STEPS)))
    run_training(config)
    return RunStorage(config.storage, config.name)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> str:
    from flows.cli import main

    path = str(tmp_path_factory.mktemp("records") / "traces.jsonl")
    assert main(["export-traces", run.url, "--steps", "1:2", "--out", path]) == 0
    return path


def cli(capsys, *args: str) -> tuple[int, str]:
    from flows.cli import main

    code = main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_verifiers_reads_the_exported_records_with_the_same_branches_tokens_and_logprobs(run, exported):
    lines = open(exported).read().splitlines()
    traces = [trace for step in STEPS for trace in read_traces(run, step)]
    assert len(lines) == len(traces) == 2 * 2 * 4  # steps x examples x rollouts
    for line, trace in zip(lines, traces):
        record = vf.WireTrace.model_validate_json(line)
        assert (record.id, record.reward, record.agent.config.model) == (trace.id, trace.reward, "tiny")
        assert [b.token_ids for b in record.branches] == [b.token_ids.tolist() for b in trace.branches]
        for theirs, ours in zip(record.branches, trace.branches):
            assert theirs.sampled_mask == ours.sampled.tolist()
            assert np.array_equal(np.asarray(theirs.logprobs, np.float32), ours.logprobs)  # every digit
            assert sum(theirs.sampled_mask) > 0


def test_replaying_the_records_through_the_runs_algorithm_writes_the_runs_batches(run, exported, tmp_path):
    from flows.replay import replay_flow

    out = RunStorage.from_url(f"{tmp_path}/replayed")
    summaries = replay_flow(run=None, traces=exported, algorithms=[AlgorithmConfig(id="grpo")], out=out.url, train=True,
                       model="tiny")
    assert [s["step"] for s in summaries] == list(STEPS)
    assert all(s["channels"]["channel/grpo/tokens"] > 0 and s["original"] == {} for s in summaries)
    for step in STEPS:
        original, replayed = (pq.read_table(s.step_path(step, "batch.parquet")) for s in (run, out))
        assert replayed.num_rows > 0 and replayed.equals(original)
    assert out.stable_steps("weights") == list(STEPS)  # --train trained a model on them
    assert json.loads(open(out.path("replay.json")).read())["source"] == exported
    printed = table_text(summaries)
    assert "replayed batches" in printed and "original" not in printed  # records have no original batches


def table_text(summaries: list[dict]) -> str:
    from rich.console import Console

    from flows.replay import comparison_table

    console = Console(width=120, record=True, file=io.StringIO())
    console.print(comparison_table(summaries, ["grpo"]))
    return console.export_text()


def test_bad_input_is_refused_in_one_line(run, exported, tmp_path, capsys):
    replay = ["replay", "--algorithms", '["grpo"]', "--out", str(tmp_path / "out")]
    assert cli(capsys, *replay, "--run", run.url, "--traces", exported) == (
        2, "error: replay: --run and --traces both name traces to replay; give one of them")

    not_records = tmp_path / "metrics.jsonl"
    not_records.write_text('{"step": 1, "reward": 0.5}\n')
    code, line = cli(capsys, *replay, "--traces", str(not_records))
    assert code == 2 and line.startswith(f"error: {not_records} line 1: not a verifiers v1 trace record; expected")

    record = json.loads(open(exported).readline())
    for node in record["nodes"]:  # what an eval client records: messages, no tokens
        node.update(token_ids=[], mask=[], logprobs=[], is_content=[])
    eval_records = tmp_path / "eval.jsonl"
    eval_records.write_text(json.dumps(record) + "\n")
    code, line = cli(capsys, *replay, "--traces", str(eval_records))
    assert code == 2 and line.startswith(f"error: {eval_records} line 1: trace {record['id']} has sampled turns "
                                         "without token ids")

    code, line = cli(capsys, *replay, "--traces", exported, "--train", "--from-step", "1")
    assert code == 2 and line.startswith("error: --from-step 1 starts from a run's weights, but --traces replays")
    assert cli(capsys, "export-traces", run.url, "--out", exported) == (
        2, f"error: --out {exported} exists; choose another file or pass --overwrite to replace it")
    assert not (tmp_path / "out").exists()


def test_records_sampled_behind_their_step_are_not_refused_as_stale(tmp_path):
    """An `[async]` run's traces of step 3 sampled with the weights of step 1 replay as they were sampled."""
    from tests.data.test_trace import make_trace
    from trace_rl.offline.replay import check_records_replay
    from trace_rl.pipeline.schedule import StaleTraceError, check_staleness
    from trace_rl.verifiers.records import write_records

    path = str(tmp_path / "async.jsonl")
    write_records(path, {3: [make_trace("a", policy_step=1), make_trace("b", policy_step=2)]})
    plan = check_records_replay(path, [AlgorithmConfig(id="grpo")], str(tmp_path / "out"))
    assert plan.steps == [3] and plan.config.async_.max_off_policy_steps == 1
    check_staleness(plan.records[3], 3, plan.config.async_.max_off_policy_steps)
    with pytest.raises(StaleTraceError):
        check_staleness(plan.records[3], 3, 0)

    # a rollout continued across steps: its first tokens sampled at step 1 with the base model, 2 steps old
    from tests.data.test_trace import make_branch
    from trace_rl.pipeline.token_age import stale

    branch = make_branch(n=7)
    branch.policy_versions = np.array([-1, -1, -1, 0, 0, 2, 2], np.int32)
    write_records(path, {3: [make_trace("c", branches=[branch], policy_step=2)]})
    plan = check_records_replay(path, [AlgorithmConfig(id="grpo")], str(tmp_path / "out"))
    assert plan.config.async_.max_off_policy_steps == 2  # the oldest token's age: so no token is masked either
    (back,) = plan.records[3]
    assert not stale(back.branches[0].policy_versions, branch.sampled, 3, plan.config.token_age_bound).any()
