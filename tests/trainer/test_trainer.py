"""The trainer end to end on the tiny model: steps, resume, checkpoints, exported weights, torchrun workers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.conftest import make_batch, storage_for
from trace_rl.tables import write_batch
from trace_rl.trainer import checkpoint
from trace_rl.trainer.run import TrainerError, train_one_step
from trace_rl.trainer.trainer import Trainer


def exported(storage, step: int) -> dict[str, torch.Tensor]:
    return load_file(f"{storage.path('weights', f'{step:06d}')}/model.safetensors")


def write_batches(storage, steps: int) -> None:
    for step in range(steps):
        write_batch(storage, step, make_batch(100 + step))


def test_step_trains_and_reports_metrics(make_config):
    config = make_config()
    trainer = Trainer(config, storage_for(config))
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    samples = make_batch(7)
    metrics = trainer.train_step(0, samples)
    rl = sum(int(s.rl_mask[1:].sum()) for s in samples)
    ce = sum(int(s.ce_mask[1:].sum()) for s in samples)
    assert metrics["tokens/rl"] == rl and metrics["tokens/ce"] == ce and rl > 0 and ce > 0
    assert metrics["tokens"] == sum(len(s) for s in samples)
    assert metrics["micro_batches"] > 1  # accumulation over several micro-batches
    assert metrics["loss"] == pytest.approx(metrics["loss/rl"] + metrics["loss/ce"])
    assert metrics["grad_norm"] > 0 and metrics["mismatch_kl"] > 0 and metrics["entropy"] > 5.0
    assert metrics["lr"] == pytest.approx(1e-3 / 2)  # warmup step 1 of 2
    assert any(not torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())


def test_step_without_masked_tokens_leaves_weights_unchanged(make_config):
    config = make_config()
    trainer = Trainer(config, storage_for(config))
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    samples = [dataclasses.replace(s, rl_mask=np.zeros(len(s), bool), ce_mask=np.zeros(len(s), bool))
               for s in make_batch(8)]
    metrics = trainer.train_step(0, samples)
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())


def test_resume_equals_uninterrupted(make_config):
    steps = 4
    straight = make_config("straight", weight_decay=0.1)
    store = storage_for(straight)
    write_batches(store, steps)
    trainer = Trainer(straight, store)
    for step in range(steps):
        train_one_step(straight, store, step, trainer)

    resumed = make_config("resumed", weight_decay=0.1)
    store2 = storage_for(resumed)
    write_batches(store2, steps)
    first = Trainer(resumed, store2)
    for step in range(2):
        train_one_step(resumed, store2, step, first, extra_state={"rae": {"baseline": np.arange(3.0)}})
    del first
    torch.manual_seed(12345)  # a restored run must not depend on this process's RNG
    second = Trainer(resumed, store2)
    restored, extra = second.restore()
    assert restored == 1 and extra["rae"]["baseline"].tolist() == [0.0, 1.0, 2.0]
    for step in range(2, steps):
        train_one_step(resumed, store2, step, second)

    a, b = exported(store, steps - 1), exported(store2, steps - 1)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(exported(store, 0)[next(iter(a))], a[next(iter(a))])


def test_training_a_step_again_is_refused(make_config):
    config = make_config()
    store = storage_for(config)
    write_batches(store, 1)
    train_one_step(config, store, 0)
    with pytest.raises(TrainerError, match="checkpoint for step 0 already exists"):
        train_one_step(config, store, 0)


def test_checkpoints_are_pruned(make_config):
    config = make_config(micro_batch_tokens=256)
    config.ckpt.keep, config.ckpt.interval = 2, 2
    store = storage_for(config)
    trainer = Trainer(config, store)
    for step in range(5):
        trainer.save_checkpoint(step, {})
    assert store.stable_steps("checkpoints") == [0, 2, 3, 4]
    store.fs.makedirs(checkpoint.checkpoint_dir(store, 5))  # a crashed write: no STABLE marker
    assert store.latest_stable("checkpoints") == 4
    trainer.save_checkpoint(6, {})
    assert store.stable_steps("checkpoints") == [0, 2, 4, 6]
    assert not store.exists(checkpoint.checkpoint_dir(store, 5))


def test_exported_weights_load_with_transformers(make_config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = make_config()
    store = storage_for(config)
    trainer = Trainer(config, store)
    trainer.train_step(0, make_batch(9))
    directory = trainer.export_weights(0)
    assert store.is_stable(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = torch.tensor([tokenizer.encode("hello")])
    trainer.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trainer.module(ids).logits, atol=0, rtol=0)


def test_checkpoint_and_weights_on_s3(make_config, s3_server):
    config = make_config().model_copy(update={
        "storage": f"s3://{s3_server['bucket']}", "storage_options": s3_server["storage_options"]})
    store = storage_for(config)
    write_batches(store, 1)
    train_one_step(config, store, 0, extra_state={"rae": {"n": 1}})
    fresh = Trainer(config, store)
    assert fresh.restore() == (0, {"rae": {"n": 1}})
    assert store.is_stable(store.path("weights", "000000"))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_processes_match_one(make_config, parallel):
    single = make_config("single", micro_batch_tokens=48)
    store1 = storage_for(single)
    write_batches(store1, 1)
    train_one_step(single, store1, 0)

    double = make_config(f"double-{parallel}", micro_batch_tokens=48, num_processes=2, parallel=parallel)
    store2 = storage_for(double)
    write_batches(store2, 1)
    metrics = train_one_step(double, store2, 0)
    assert metrics["tokens"] == sum(len(s) for s in make_batch(100))

    a, b = exported(store1, 0), exported(store2, 0)
    initial = load_file(f"{single.model.name}/model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    assert max((a[k] - initial[k]).abs().max().item() for k in initial) > 1e-4
    assert store2.latest_stable("checkpoints") == 0


def test_bfloat16_step_and_export(make_config):
    config = make_config()
    config.model.dtype = "bfloat16"
    store = storage_for(config)
    trainer = Trainer(config, store)
    metrics = trainer.train_step(0, make_batch(10))
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    directory = trainer.export_weights(0)
    weights = load_file(f"{directory}/model.safetensors")
    exported_dtype = store.read_json(f"{directory}/config.json").get("dtype")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16} and exported_dtype == "bfloat16"
