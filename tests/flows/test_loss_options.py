"""[trainer.loss] options end to end on the hf backend: a KL penalty's reference scored into the batch and its
term logged, a replay with another policy loss training differently on the same traces, and the docs' loss of
your own trained through the CLI on two torchrun ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.flows.conftest import small_config
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage

ROOT = Path(__file__).resolve().parents[2]


def test_a_kl_step_carries_the_reference_logprobs_in_the_batch_and_logs_loss_kl(prefect_api, tmp_path):
    from flows.train import run_training

    data = small_config(str(tmp_path), "kl", steps=1, models={"reference": {"name": "tiny", "tokens": True}})
    data["trainer"]["loss"] = {"kl": {"model": "reference", "coef": 0.5, "estimator": "k3"}}
    config = validate_config(data)
    run_training(config)
    storage = RunStorage(config.storage, config.name)
    table = pq.read_table(storage.fs.open(storage.step_path(1, "batch.parquet"), "rb"))
    assert "ref_logprobs" in table.column_names
    ref = table.column("ref_logprobs").to_pylist()
    ids = table.column("input_ids").to_pylist()
    assert [len(r) for r in ref] == [len(i) for i in ids]
    inference = table.column("inference_logprobs").to_pylist()
    # a tiny reference of another seed: its logprobs differ from the sampler's
    assert any(abs(a - b) > 1e-3 for r, i in zip(ref, inference) for a, b in zip(r[1:], i[1:]))
    metrics = storage.read_json(storage.step_path(1, "metrics.json"))
    assert metrics["train/loss/kl"] > 0  # k3 >= 0, and the reference differs
    assert metrics["train/loss"] == pytest.approx(
        metrics["train/loss/rl"] + metrics["train/loss/ce"] + metrics["train/loss/kl"])


@pytest.fixture(scope="module")
def source_run(prefect_api, tmp_path_factory) -> RunStorage:
    from flows.train import run_training

    config = validate_config(small_config(str(tmp_path_factory.mktemp("runs")), "source", steps=2))
    run_training(config)
    return RunStorage(config.storage, config.name)


def replayed_weights(run: RunStorage, out: str, overrides: list[str]) -> dict:
    from safetensors.numpy import load

    from flows.replay import replay_flow
    from trace_rl.storage import step_name

    storage = RunStorage.from_url(out)
    replay_flow(run=run.url, algorithms=[AlgorithmConfig(id="grpo")], out=storage.url, train=True, overrides=overrides)
    return load(storage.read_bytes(storage.path("weights", step_name(2), "model.safetensors")))


def test_replay_with_set_policy_cispo_trains_differently_on_the_same_traces(source_run, tmp_path):
    default = replayed_weights(source_run, f"{tmp_path}/dppo", [])
    again = replayed_weights(source_run, f"{tmp_path}/dppo-again", [])
    cispo = replayed_weights(source_run, f"{tmp_path}/cispo", ["trainer.loss.policy=cispo"])
    assert default.keys() == cispo.keys()
    assert all((default[k] == again[k]).all() for k in default)  # the same traces and loss: bitwise the same
    assert any(not (default[k] == cispo[k]).all() for k in default)  # another loss: other weights


def test_the_docs_own_loss_trains_through_the_cli_on_two_ranks(prefect_api, tmp_path, tiny_model_path):
    """`trace-rl train configs/topr.toml` for one step on the hf sampler and two torchrun ranks, each of which
    imports configs/losses/topr.py to find "topr": the logged rl loss is topr's on the step's batch (on-policy every
    weight is 1 within the sampler/trainer mismatch: -sum A_t lp_t / N, not dppo's -sum A_t r_t / N) and the
    weights moved."""
    import numpy as np
    from safetensors.numpy import load, load_file

    from trace_rl.tables import read_batch

    sets = [f"storage={tmp_path}", "steps=1", "inference.backend=hf", "env.0.batch_size=2", "env.0.group_size=4",
            "trainer.num_processes=2", "trainer.micro_batch_tokens=256", "inference.max_model_len=256"]
    # a process of its own, as a user's: the CLI stops its process's vLLM engines when it ends (the session's too)
    trained_run = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(ROOT / "configs" / "topr.toml"),
                                  *(a for s in sets for a in ("--set", s))], cwd=ROOT, capture_output=True, text=True,
                                 timeout=600, check=False)
    assert trained_run.returncode == 0, trained_run.stderr[-3000:]
    storage = RunStorage(str(tmp_path), "topr")
    logged = storage.read_json(storage.step_path(1, "metrics.json"))["train/loss/rl"]
    batch = read_batch(storage, 1)
    tokens = sum(int(s.rl_mask.sum()) for s in batch)
    advantage_sum = sum(float(s.rl_values[s.rl_mask].sum()) for s in batch)
    expected = -sum(float((s.rl_values * s.inference_logprobs)[s.rl_mask].sum()) for s in batch) / tokens
    assert logged == pytest.approx(expected, rel=1e-4)
    assert -advantage_sum / tokens != pytest.approx(expected, rel=1e-2)  # about dppo's loss: far from topr's
    trained = load(storage.read_bytes(storage.path("weights", "000001", "model.safetensors")))
    base = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert any(not np.array_equal(trained[k], base[k]) for k in base)
