"""The eval flow against a real Prefect server: inside training (without touching its randomness), resumed,
and on demand with `trace-rl eval`."""

from __future__ import annotations

import io
import os
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from tests.bitwise import difference
from tests.flows.conftest import small_config
from tests.flows.test_lifecycle import cli
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage

EVAL = {"interval": 2, "k": 4, "num_examples": 3, "pass_reward": 0.5,
        "envs": [{"id": "reverse-text", "args": {"min_length": 3, "max_length": 4}}]}


def eval_dir(config, step: int) -> Path:
    return Path(RunStorage(config.storage, config.name).path("eval", f"step_{step:06d}"))


@pytest.fixture(scope="module")
def runs(prefect_api, tmp_path_factory):
    """The same 4-step run twice: without eval, and with eval every 2 steps."""
    from flows.train import run_training

    storage = str(tmp_path_factory.mktemp("runs"))
    plain = validate_config(small_config(storage, "no-eval", steps=4, ckpt={"keep": 4}))  # every step's weights
    evaluated = validate_config(small_config(storage, "with-eval", steps=4, eval=EVAL, ckpt={"keep": 4}))
    run_training(plain)
    run_training(evaluated)
    return plain, evaluated


def test_eval_every_2_steps_leaves_the_training_weights_bitwise_identical(runs):
    plain, evaluated = runs
    for step in (1, 2, 3, 4):
        for config in runs:
            assert RunStorage(config.storage, config.name).is_stable(
                RunStorage(config.storage, config.name).path("weights", f"{step:06d}"))
        a, b = (Path(RunStorage(c.storage, c.name).path("weights", f"{step:06d}", "model.safetensors")).read_bytes()
                for c in runs)
        assert (why := difference(a, b)) is None, f"weights of step {step} differ with eval: {why}"
    assert [eval_dir(evaluated, s).joinpath("STABLE").exists() for s in (1, 2, 3, 4)] == [False, True, False, True]
    assert not eval_dir(plain, 2).parent.exists()


def test_eval_writes_its_metrics_per_env(runs):
    _, evaluated = runs
    metrics = pq.read_table(eval_dir(evaluated, 4) / "metrics.parquet").to_pylist()
    samples = pq.read_table(eval_dir(evaluated, 4) / "samples.parquet").to_pylist()
    assert [row["env"] for row in metrics] == ["reverse-text"]
    row = metrics[0]
    assert set(row) == {"env", "step", "examples", "k", "reward_mean", "avg@k", "pass@1", "pass@2", "pass@4",
                        "completion_tokens_mean", "error_fraction"}
    assert (row["step"], row["examples"], row["k"]) == (4, 3, 4)
    assert len(samples) == 12 and len({s["example_id"] for s in samples}) == 3
    correct = [sum(s["correct"] for s in samples if s["example_id"] == e) for e in dict.fromkeys(
        s["example_id"] for s in samples)]
    assert row["avg@k"] == pytest.approx(sum(correct) / 12) == pytest.approx(row["pass@1"])
    assert row["pass@1"] <= row["pass@2"] <= row["pass@4"] == pytest.approx(sum(c > 0 for c in correct) / 3)
    assert row["reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 12)
    assert row["completion_tokens_mean"] == pytest.approx(sum(s["completion_tokens"] for s in samples) / 12)
    assert row["completion_tokens_mean"] > 0
    assert row["error_fraction"] == 0.0
    traces = pq.read_table(eval_dir(evaluated, 4) / "traces.parquet", columns=["trace_id", "policy_step"])
    assert traces.num_rows == 12 and set(traces.column("policy_step").to_pylist()) == {4}


def test_eval_table_artifact_on_the_server(prefect_api, runs):
    artifacts = httpx.post(f"{prefect_api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["with-eval-eval"]}}}
                           ).json()
    assert len(artifacts) == 2 and {a["type"] for a in artifacts} == {"table"}


def test_resume_reruns_only_an_unfinished_eval(runs):
    """The process died after step 4 but before its eval: resume evaluates step 4, and reads step 2's back."""
    from flows.train import run_training

    _, evaluated = runs
    before = (eval_dir(evaluated, 4) / "metrics.parquet").read_bytes()
    stamp = os.stat(eval_dir(evaluated, 2) / "metrics.parquet").st_mtime_ns
    (eval_dir(evaluated, 4) / "STABLE").unlink()
    run_training(evaluated, resume=True)
    assert (eval_dir(evaluated, 4) / "STABLE").exists()
    # same weights, same seeds: the same numbers
    assert pq.read_table(eval_dir(evaluated, 4) / "metrics.parquet").equals(pq.read_table(io.BytesIO(before)))
    assert os.stat(eval_dir(evaluated, 2) / "metrics.parquet").st_mtime_ns == stamp


def test_cli_eval_of_a_finished_runs_checkpoint(prefect_api, runs):
    _, evaluated = runs
    url = RunStorage(evaluated.storage, evaluated.name).url
    done = cli("eval", url, "--step", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval of step 3" in done.stdout + done.stderr and "pass@4" in done.stdout + done.stderr
    metrics = pq.read_table(eval_dir(evaluated, 3) / "metrics.parquet").to_pylist()
    assert metrics[0]["step"] == 3 and (eval_dir(evaluated, 3) / "STABLE").exists()
    stamp = os.stat(eval_dir(evaluated, 3) / "metrics.parquet").st_mtime_ns
    again = cli("eval", url, "--step", "3", "--set", "eval.k=2")
    assert again.returncode == 0, again.stderr[-3000:]
    # other [eval] settings: evaluated again with them, not read back from the k = 4 eval
    redone = pq.read_table(eval_dir(evaluated, 3) / "metrics.parquet").to_pylist()
    assert [row["k"] for row in redone] == [2] and [row["k"] for row in metrics] == [4]
    assert os.stat(eval_dir(evaluated, 3) / "metrics.parquet").st_mtime_ns != stamp


def test_a_finished_eval_is_read_back_only_with_the_same_settings(runs):
    from trace_rl.eval.evaluation import finished_eval

    _, evaluated = runs
    storage = RunStorage(evaluated.storage, evaluated.name)
    rows = finished_eval(evaluated, storage, 2)
    assert rows is not None and rows[0]["step"] == 2
    for change in ({"k": 8}, {"num_examples": 5}, {"sampling": {"temperature": 0.5}}, {"interval": 3}):
        changed = validate_config({**evaluated.model_dump(mode="json", by_alias=True),
                                   "eval": {**EVAL, **change}})
        assert (finished_eval(changed, storage, 2) is None) == ("interval" not in change), change
    reseeded = validate_config({**evaluated.model_dump(mode="json", by_alias=True), "seed": evaluated.seed + 1})
    assert finished_eval(reseeded, storage, 2) is None


def test_cli_eval_refuses_a_run_without_eval_or_weights(prefect_api, runs):
    plain, evaluated = runs
    no_eval = cli("eval", RunStorage(plain.storage, plain.name).url, "--step", "4")
    assert no_eval.returncode == 2 and "has no [eval] section" in no_eval.stderr
    no_weights = cli("eval", RunStorage(evaluated.storage, evaluated.name).url, "--step", "9")
    assert no_weights.returncode == 2 and "--step 9" in no_weights.stderr and "[1, 2, 3, 4]" in no_weights.stderr


def test_eval_with_async_sampling_scores_the_weights_of_its_step(runs):
    """With `[async] max_off_policy_steps = 1` the sampler runs older weights than the step's: the eval of step 4
    still scores `weights/4`, giving the synchronous run's numbers."""
    from trace_rl.eval.evaluation import evaluate
    from trace_rl.pipeline.session import session_for
    from trace_rl.aio import run_sync

    _, evaluated = runs
    before = pq.read_table(eval_dir(evaluated, 4) / "metrics.parquet")
    (eval_dir(evaluated, 4) / "STABLE").unlink()
    data = evaluated.model_dump(mode="json", by_alias=True)
    data["async"] = {"max_off_policy_steps": 1}
    run_sync(evaluate(session_for(validate_config(data)), 4))
    assert pq.read_table(eval_dir(evaluated, 4) / "metrics.parquet").equals(before)
