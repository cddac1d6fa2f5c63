"""Replay of a finished run whose weights `[ckpt]` pruned: algorithms that read no model replay every step without
loading any weights or starting any runtime; one that scores with the policy is refused before anything starts."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.flows.conftest import small_config
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.errors import RefusedError
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage

STEPS = 3
GRPO_ECHO = [AlgorithmConfig(id="grpo"), AlgorithmConfig(id="echo")]


@pytest.fixture(scope="module")
def pruned_run(prefect_api, tmp_path_factory) -> RunStorage:
    """Three steps whose weights are pruned like checkpoints (`keep = 2`): weights/1 is gone."""
    from flows.train import run_training

    ckpt = {"keep": 2, "keep_weights_every": 0}
    config = validate_config(small_config(str(tmp_path_factory.mktemp("runs")), "pruned", steps=STEPS, ckpt=ckpt))
    run_training(config)
    storage = RunStorage(config.storage, config.name)
    assert storage.stable_steps("weights") == [2, 3]
    return storage


def built_runtimes(run: RunStorage, algorithms: list[AlgorithmConfig]) -> list:
    """The runtimes the replay's session built (the session is the process's, kept after the flow)."""
    from trace_rl.offline.replay import replay_config, source_config
    from trace_rl.pipeline.session import session_for

    return session_for(replay_config(source_config(run.url), algorithms)).runtimes.built()


@pytest.mark.parametrize("train", [False, True], ids=["batches", "train"])
def test_every_step_of_a_pruned_run_replays_through_grpo_and_echo_without_weights(pruned_run, tmp_path, train):
    from flows.replay import replay_flow

    out = RunStorage.from_url(f"{tmp_path}/replayed")
    summaries = replay_flow(run=pruned_run.url, algorithms=GRPO_ECHO, out=out.url, train=train)
    assert [s["step"] for s in summaries] == [1, 2, 3]
    assert all(s["channels"]["channel/grpo/tokens"] > 0 for s in summaries)
    assert built_runtimes(pruned_run, GRPO_ECHO) == []  # no sampler, no weights loaded
    original = pq.read_table(pruned_run.step_path(1, "batch.parquet"))
    assert pq.read_table(out.step_path(1, "batch.parquet")).num_rows == original.num_rows
    assert out.stable_steps("weights") == ([2, 3] if train else [])  # a replay --train prunes like its source


def test_opsd_on_steps_whose_weights_were_pruned_is_refused_before_anything_is_written(pruned_run, tmp_path):
    from flows.replay import replay_flow

    out = tmp_path / "opsd"
    with pytest.raises(RefusedError) as refused:
        replay_flow(run=pruned_run.url, algorithms=[AlgorithmConfig(id="opsd")], out=str(out))
    message = str(refused.value)
    # step 2 samples with weights/1 (pruned); step 1 with the base model, step 3 with weights/2 (kept)
    assert "'opsd'" in message and "weights of step 1 were pruned" in message and "weights of steps 2:3:" in message
    assert "--steps within 1, 3" in message and "keep_weights_every = 1" in message
    assert not out.exists()


def test_cli_replay_refusals_are_one_line_with_exit_code_2(pruned_run, tmp_path, capsys):
    from flows.cli import main

    out = tmp_path / "cli"
    common = ["replay", "--run", pruned_run.url, "--out", str(out)]
    cases = {
        "opsd": [*common, "--algorithms", '["opsd"]', "--steps", "2"],
        "from-step": [*common, "--algorithms", '["grpo"]', "--train", "--from-step", "1"],
        "no-train": [*common, "--algorithms", '["grpo"]', "--from-step", "2"],
    }
    expected = {"opsd": "--algorithms: 'opsd' scores with the policy's weights", "from-step": "--from-step 1: the run has no weights of "
                "step 1", "no-train": "--from-step says which model --train starts from"}
    for case, argv in cases.items():
        assert main(argv) == 2, case
        err = capsys.readouterr().err
        assert err.startswith(f"error: {expected[case]}") and err.count("\n") == 1, (case, err)
        assert not out.exists(), case
