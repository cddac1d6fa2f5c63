"""Activation checkpointing and FSDP2 mixed precision: the same step, less memory. (Two gloo ranks with activation
checkpointing against one process: tests/trainer/test_trainer.py::test_gloo_workers_match_one_process.)"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.conftest import make_batch, storage_for
from tests.trainer.test_trainer import exported, write_batches
from trace_rl.trainer.lifecycle import train_one_step
from trace_rl.trainer.trainer import Trainer


def block_calls(trainer: Trainer) -> list[int]:
    """Counts the calls of the first decoder block (a recomputation in backward is a second call; a pre-hook,
    since recomputation stops early, once it has what backward needs, before a forward hook would run)."""
    calls = [0]

    def count(*_):
        calls[0] += 1

    trainer.module.get_decoder().layers[0].register_forward_pre_hook(count)
    return calls


def test_activation_checkpointing_recomputes_blocks_and_gives_the_same_step(make_config):
    plain = Trainer(make_config("plain"), storage_for(make_config("plain")))
    config = make_config("checkpointed", activation_checkpointing=True)
    checkpointed = Trainer(config, storage_for(config))
    assert checkpointed.module.is_gradient_checkpointing and not plain.module.is_gradient_checkpointing
    calls = block_calls(plain), block_calls(checkpointed)

    samples = make_batch(7)
    a, b = plain.optimizer_step(1, samples), checkpointed.optimizer_step(1, samples)
    micro_batches = int(a["micro_batches"])
    assert calls[0][0] == micro_batches and calls[1][0] == 2 * micro_batches  # forward, then again in backward
    assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6
    for p, q in zip(plain.module.parameters(), checkpointed.module.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_fsdp_in_bfloat16_computes_with_bfloat16_parameters(make_config):
    """With the policy, norms and embeddings also compute on bf16 copies (autocast alone keeps them float32), as
    they do on one process's bfloat16 compute copy: the exported weights are one process's but for a few values a
    bf16 ulp apart, where the float32 master weights' sums (in another order) round to the other side (none on a
    Zen 5, 3 of 435,328 on a 2-core AMX Xeon). Under autocast they were 1.2e-3 (a bf16 ulp of the larger weights)
    apart."""
    single = make_config("single-bf16", micro_batch_tokens=48)
    single.model.dtype = "bfloat16"
    store1 = storage_for(single)
    write_batches(store1, 1)
    expected = train_one_step(single, store1, 0)

    double = make_config("fsdp-bf16", micro_batch_tokens=48, num_processes=2, parallel="fsdp")
    double.model.dtype = "bfloat16"
    store2 = storage_for(double)
    write_batches(store2, 1)
    metrics = train_one_step(double, store2, 0)
    assert abs(metrics["loss"] - expected["loss"]) <= 1e-3
    a, b = exported(store1, 0), exported(store2, 0)
    assert {w.dtype for w in b.values()} == {torch.bfloat16}
    # without the policy FSDP2 would compute under autocast on float32 weights: a bf16 ulp apart
    apart = {k: (a[k].float() - b[k].float()).abs() for k in a}
    larger = {k: torch.maximum(a[k].float().abs(), b[k].float().abs()) for k in a}
    ulp = {k: torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 8) for k, x in larger.items()}  # bf16's
    assert all(bool((apart[k] <= ulp[k]).all()) for k in a)
    assert sum(int((d > 0).sum()) for d in apart.values()) <= 1e-4 * sum(d.numel() for d in apart.values())
