"""bench.bf16_profile's op counter on a bfloat16 step of the tiny model: the structure issue 44 asks for, pinned.

The weights are cast once per step whatever the number of micro-batches (the compute copy's refresh, and the
float32 output layer's copy of its bfloat16 weight), and the only float32 matmuls are that output layer's (its
forward and its recomputation in backward, one per chunk: the tiny model's 256 tokens, one chunk per
micro-batch) and the attention's (on CPU float32 GEMMs of the bfloat16 q, k and v, `gemm_attention`: two per layer
forward, four backward). Everything else computes in bfloat16.
"""

from __future__ import annotations

from bench.bf16_profile import counted_step, summary
from tests.trainer.conftest import make_batch
from trace_rl.config import Config
from trace_rl.storage import RunStorage
from trace_rl.trainer.trainer import Trainer


def test_a_bfloat16_step_casts_its_weights_once_and_computes_in_bfloat16(tiny_model_path, tmp_path):
    config = Config(name="bf16", storage=str(tmp_path), env=[{"id": "synthetic"}],
                    model={"name": tiny_model_path, "dtype": "bfloat16"}, inference={"max_model_len": 64},
                    trainer={"micro_batch_tokens": 64, "device": "cpu"})
    trainer = Trainer(config, RunStorage.of(config))
    trainer.optimizer_step(0, make_batch(2))  # the copy is made with the weights: the next step's refresh casts them
    ops = counted_step(trainer, 1, make_batch(3))
    assert ops.micro_batches >= 3
    trainable = sum(1 for p in trainer.module.parameters() if p.requires_grad)
    weight_casts = {(phase, op, dtypes): row.count for (kind, phase, op, dtypes), row in ops.rows.items()
                    if kind == "weight cast"}
    assert weight_casts == {("forward", "copy_", "f32->bf16"): trainable, ("forward", "copy_", "bf16->f32"): 1}
    matmuls = {(phase, op, dtypes): row.count for (kind, phase, op, dtypes), row in ops.rows.items()
               if kind == "matmul" and "f32" in dtypes}
    attention = trainer.module.config.num_hidden_layers * ops.micro_batches
    assert matmuls == {("forward", "mm", "f32->f32"): ops.micro_batches,
                       ("backward", "mm", "f32->f32"): ops.micro_batches,
                       ("forward", "bmm", "f32->f32"): 2 * attention, ("backward", "bmm", "f32->f32"): 4 * attention}
    assert {dtypes for (kind, _, _, dtypes) in ops.rows if kind == "matmul"} == {"f32->f32", "bf16->bf16"}
    assert 0 < summary(ops)["float32_matmul_flops_share"] < 1
