"""[trainer.loss] options end to end on the hf backend: a KL penalty's reference scored into the batch and its
term logged, and a replay with another policy loss training differently on the same traces."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.flows.conftest import small_config
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage


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
