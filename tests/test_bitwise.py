"""tests/bitwise.py and `weights_difference`: a failed bitwise comparison names what differs, in one short line."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.numpy import save
from safetensors.torch import save as save_torch

from tests.bitwise import difference, weights_difference
from trace_rl.storage import RunStorage


def test_weights_that_differ_are_named_with_how_many_values_and_by_how_much():
    weights = {"a.weight": np.ones((4, 8), np.float32), "b.bias": np.zeros(8, np.float32)}
    other = {name: value.copy() for name, value in weights.items()}
    other["b.bias"][[1, 5]] = [2.5e-7, -1e-3]
    assert difference(save(weights), save(weights)) is None
    why = difference(save(weights), save(other))
    assert why == "1 of 2 tensors differ: b.bias in 2 of 8 values (by up to 0.001)"
    other["c"] = np.zeros(1, np.float32)
    assert difference(save(weights), save(other)) == "other tensors: ['c']"
    half = save_torch({"w": torch.ones(4, dtype=torch.bfloat16)}), save_torch({"w": torch.full((4,), 2.0).bfloat16()})
    assert difference(*half) == "1 of 1 tensors differ: w in 4 of 4 values (by up to 1)"


def test_other_files_say_their_sizes_and_first_differing_byte():
    assert difference(b"PAR1abc", b"PAR1abd") == "7 against 7 bytes, the first difference at byte 6"
    assert difference(b"PAR1", b"PAR1x") == "4 against 5 bytes, the first difference at byte 4"


def write_run(tmp_path, name: str, biases: list[float], batches: list[list[int]]) -> RunStorage:
    """A run's weights (STABLE), batch and training metrics of steps 1.. as the pipeline lays them out."""
    storage = RunStorage(str(tmp_path), name)
    for step, (bias, ids) in enumerate(zip(biases, batches), start=1):
        weights = storage.path("weights", f"{step:06d}")
        storage.write_atomic(f"{weights}/model.safetensors", save({"b": np.full(3, bias, np.float32)}))
        storage.mark_stable(weights)
        table = io.BytesIO()
        pq.write_table(pa.table({"input_ids": [ids]}), table)
        storage.write_atomic(storage.step_path(step, "batch.parquet"), table.getvalue())
        storage.write_json(storage.step_path(step, "train_metrics.json"), {"loss": bias, "grad_norm": 1.0})
    return storage


def test_two_runs_are_told_apart_at_their_first_differing_step(tmp_path):
    reference = write_run(tmp_path, "reference", [0.0, 1.0, 2.0], [[1], [2], [3]])
    assert weights_difference(write_run(tmp_path, "same", [0.0, 1.0, 2.0], [[1], [2], [3]]), reference) is None
    run = write_run(tmp_path, "run", [0.0, 1.5, 2.5], [[1], [2], [4]])
    assert weights_difference(run, reference) == (
        "the weights of step 2 differ first (1 of 1 tensors differ: b in 3 of 3 values (by up to 0.5)); its batch is "
        "the same; trained here: {'loss': 1.5, 'grad_norm': 1.0, 'entropy': None, "
        "'mismatch/mean_abs_logprob_diff': None}, in the reference: {'loss': 1.0, 'grad_norm': 1.0, 'entropy': None, "
        "'mismatch/mean_abs_logprob_diff': None}")
    late = weights_difference(write_run(tmp_path, "late", [0.0, 1.0, 9.0], [[1], [2], [4]]), reference)
    assert late.startswith("the weights of step 3 differ first") and "its batch is different" in late
