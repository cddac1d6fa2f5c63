"""LoRA training (`[model.lora]`): only the adapter trains, checkpoints hold it and its optimizer state, resume
is bitwise, and `weights/<step>/` is a peft adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.conftest import make_batch, storage_for
from tests.trainer.test_trainer import write_batches
from trace_rl.trainer import checkpoint
from trace_rl.trainer.lifecycle import train_one_step
from trace_rl.trainer.trainer import Trainer

LORA = {"rank": 4, "alpha": 8.0}


@pytest.fixture
def lora_config(make_config):
    def build(name: str = "lora", lora: dict | None = None, **trainer):
        config = make_config(name, **trainer)
        config.model.lora = {**LORA, **(lora or {})}  # validated on assignment
        config.ckpt.keep = 10  # every step's adapter stays: the tests compare them step by step
        return config

    return build


def adapter_of(storage, step: int) -> dict[str, torch.Tensor]:
    return load_file(f"{storage.path('weights', f'{step:06d}')}/adapter_model.safetensors")


def test_only_adapter_parameters_change_and_the_base_stays_bitwise(lora_config):
    config = lora_config()
    store = storage_for(config)
    write_batches(store, 3)
    trainer = Trainer(config, store)
    trainable = trainer.trainable_names()
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 7 projections x 2 layers x (A, B)
    assert len(trainable) == 28
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    for step in range(3):
        train_one_step(config, store, step, trainer)
    after = trainer.module.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # every lora_B starts at 0 and moves; the frozen base (and every non-adapter tensor) is bitwise the same
    assert {k for k in trainable if ".lora_B." in k} <= changed <= trainable
    # the optimizer holds state for the adapter alone
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)
    assert sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]) == sum(
        trainer.module.get_parameter(n).numel() for n in trainable)


def test_checkpoint_and_weights_hold_the_adapter_only(lora_config, tiny_model_path):
    config = lora_config()
    store = storage_for(config)
    write_batches(store, 1)
    train_one_step(config, store, 0)
    model = checkpoint.load_part(store, 0, "model")
    optimizer = checkpoint.load_part(store, 0, "optimizer")
    assert model and all(".lora_" in name for name in model)
    assert set(optimizer["state"]) == set(model)
    directory = store.path("weights", "000000")
    with open(f"{directory}/adapter_config.json") as f:
        adapter_config = json.load(f)
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8.0 and adapter_config["peft_type"] == "LORA"
    assert sorted(adapter_config["target_modules"]) == sorted(config.model.lora.target_modules)
    tensors = adapter_of(store, 0)
    assert len(tensors) == 28 and all(name.startswith("base_model.model.model.layers.") for name in tensors)
    assert {tuple(t.shape) for n, t in tensors.items() if "q_proj.lora_A" in n} == {(4, 128)}
    full = sum(t.numel() for t in load_file(f"{tiny_model_path}/model.safetensors").values())
    assert sum(t.numel() for t in tensors.values()) < full / 10


def test_resume_is_bitwise(lora_config):
    steps = 4
    straight = lora_config("straight", weight_decay=0.1, lora={"dropout": 0.1})
    store = storage_for(straight)
    write_batches(store, steps)
    trainer = Trainer(straight, store)
    for step in range(steps):
        train_one_step(straight, store, step, trainer)

    resumed = lora_config("resumed", weight_decay=0.1, lora={"dropout": 0.1})
    store2 = storage_for(resumed)
    write_batches(store2, steps)
    first = Trainer(resumed, store2)
    for step in range(2):
        train_one_step(resumed, store2, step, first)
    del first
    torch.manual_seed(999)  # neither the adapter's init nor dropout may depend on this process's RNG after restore
    second = Trainer(resumed, store2)
    assert second.restore()[0] == 1
    for step in range(2, steps):
        train_one_step(resumed, store2, step, second)

    a, b = adapter_of(store, steps - 1), adapter_of(store2, steps - 1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(adapter_of(store, 0)[k], a[k]) for k in a)
    assert all(torch.equal(p, q) for p, q in zip(trainer.module.parameters(), second.module.parameters()))


def test_a_checkpoint_of_another_adapter_is_refused(lora_config):
    config = lora_config("changed")
    store = storage_for(config)
    write_batches(store, 1)
    train_one_step(config, store, 0)
    other = lora_config("changed", lora={"target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(ValueError, match=r"does not hold this run's LoRA adapter .*\[model.lora\] changed"):
        Trainer(other, store).restore()


def test_lora_learns_the_batch(lora_config):
    """A few steps on one batch raise the logprobs of its ce tokens: the adapter is in the forward pass."""
    from trace_rl.trainer.packing import pack
    from trace_rl.trainer.trainer import token_logprobs

    config = lora_config(lr=1e-2)
    trainer = Trainer(config, storage_for(config))
    samples = make_batch(5)

    def ce_logprob() -> float:
        with torch.no_grad():
            batches = pack(samples, 4096, False)
            return sum(float((token_logprobs(trainer.model, b, trainer.device)[0].numpy() * b.ce_mask).sum())
                       for b in batches)

    start = ce_logprob()
    for step in range(5):
        trainer.optimizer_step(step, samples)
    assert ce_logprob() > start + 1.0


@pytest.mark.slow
def test_two_ddp_processes_train_the_same_adapter_as_one(lora_config):
    single = lora_config("single", micro_batch_tokens=48)
    store1 = storage_for(single)
    write_batches(store1, 1)
    train_one_step(single, store1, 0)

    double = lora_config("double", micro_batch_tokens=48, num_processes=2, parallel="ddp")
    store2 = storage_for(double)
    write_batches(store2, 1)
    train_one_step(double, store2, 0)
    a, b = adapter_of(store1, 0), adapter_of(store2, 0)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    assert max(a[k].abs().max().item() for k in a if ".lora_B." in k) > 1e-4
    assert set(checkpoint.load_part(store2, 0, "model")) == set(checkpoint.load_part(store1, 0, "model"))


def test_a_restored_trainer_exports_the_same_adapter(lora_config):
    """What `step.train` does when the process died after the checkpoint but before the weights."""
    config = lora_config("reexport")
    store = storage_for(config)
    write_batches(store, 1)
    train_one_step(config, store, 0)
    written = adapter_of(store, 0)
    store.remove(store.path("weights", "000000"))
    trainer = Trainer(config, store)
    assert trainer.restore()[0] == 0
    trainer.export_weights(0)
    again = adapter_of(store, 0)
    assert again.keys() == written.keys() and all(torch.equal(written[k], again[k]) for k in written)
