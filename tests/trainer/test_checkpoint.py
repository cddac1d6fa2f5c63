"""Checkpoint cost: full checkpoints every `ckpt.interval` steps, weights every step, `ckpt.keep` of each."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.trainer.conftest import make_batch, storage_for
from tests.trainer.test_trainer import exported
from trace_rl.errors import StorageFullError
from trace_rl.storage import step_name
from trace_rl.tables import write_batch
from trace_rl.trainer import checkpoint
from trace_rl.trainer.lifecycle import train_one_step
from trace_rl.trainer.trainer import Trainer

STEPS = 6


def interval_config(make_config, name: str):
    config = make_config(name, weight_decay=0.1)
    config.steps = STEPS
    config.ckpt.keep, config.ckpt.interval = 2, 2
    config.ckpt.keep_weights_every = 0  # weights pruned like checkpoints: these tests are about pruning
    return config


def train_steps(config, steps: range, trainer=None):
    store = storage_for(config)
    trainer = trainer or Trainer(config, store)
    for step in steps:
        if not store.exists(store.step_path(step, "batch.parquet")):
            write_batch(store, step, make_batch(100 + step))
        train_one_step(config, store, step, trainer, extra_state={"step": step})
    checkpoint.WRITER.wait()  # the checkpoints of steps before the run's last are written in the background
    return store


def test_writes_checkpoint_every_interval_and_at_the_last_step(make_config):
    config = interval_config(make_config, "which")
    config.ckpt.interval = 4
    assert [s for s in range(1, STEPS + 1) if checkpoint.writes_checkpoint(config, s)] == [4, 6]


def test_kept_steps_hold_the_weights_each_kept_checkpoint_resumes_with():
    assert checkpoint.kept_steps([2, 4, 6], [4, 5, 6], keep=2) == ({4, 6}, {4, 5, 6})
    assert checkpoint.kept_steps([5], [5, 6, 7, 8], keep=2) == ({5}, {5, 7, 8})
    assert checkpoint.kept_steps([], [1], keep=1) == (set(), {1})
    # [async] max_off_policy_steps = 1: a resume from checkpoint 4 samples step 5 with weights/3
    assert checkpoint.kept_steps([2, 4, 6], [1, 2, 3, 4, 5, 6], keep=2, lag=1) == ({4, 6}, {3, 4, 5, 6})
    assert checkpoint.kept_steps([6], [1, 2, 3, 4, 5, 6], keep=1, lag=2) == ({6}, {4, 5, 6})


def test_keep_weights_every_keeps_the_weights_of_every_nth_step_besides_the_last():
    assert checkpoint.kept_steps([6], [1, 2, 3, 4, 5, 6], keep=1, weights_every=1) == ({6}, {1, 2, 3, 4, 5, 6})
    assert checkpoint.kept_steps([6], [1, 2, 3, 4, 5, 6], keep=1, weights_every=4) == ({6}, {4, 6})
    assert checkpoint.kept_steps([3, 6], [1, 2, 3, 4, 5, 6, 7], keep=1, weights_every=3) == ({6}, {3, 6, 7})


def test_unfinished_directories_are_removed(make_config):
    config = interval_config(make_config, "unfinished")
    store = train_steps(config, range(1, 3))
    store.fs.makedirs(checkpoint.checkpoint_dir(store, 1))  # a crashed write: no STABLE marker
    train_steps(config, range(3, 5))
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.path("checkpoints"))) == ["000002", "000004"]
    assert store.stable_steps("weights") == [2, 3, 4]


def test_keep_two_leaves_exactly_the_expected_directories_and_a_resume_from_the_newest_reruns_bitwise(make_config):
    straight = train_steps(interval_config(make_config, "straight"), range(1, STEPS + 1))
    # checkpoints at 2, 4, 6 (the last step); the last two stay, with the weights of 5, 6 and of checkpoint 4
    assert straight.stable_steps("checkpoints") == [4, 6]
    assert straight.stable_steps("weights") == [4, 5, 6]
    assert sorted(p.rsplit("/", 1)[-1] for p in straight.fs.ls(straight.path("checkpoints"))) == ["000004", "000006"]
    assert sorted(p.rsplit("/", 1)[-1] for p in straight.fs.ls(straight.path("weights"))) == [
        "000004", "000005", "000006"]
    assert checkpoint.load_part(straight, 6, "extra_state") == {"step": 6}

    config = interval_config(make_config, "crashed")
    crashed = train_steps(config, range(1, 6))  # dies during step 6: checkpoints 2 and 4, weights 2, 4 and 5
    assert crashed.stable_steps("checkpoints") == [2, 4] and crashed.stable_steps("weights") == [2, 4, 5]

    torch.manual_seed(999)  # a resumed process must not depend on its own RNG
    trainer = Trainer(config, crashed)
    assert trainer.restore() == (4, {"step": 4})
    train_steps(config, range(5, STEPS + 1), trainer)  # steps 5 and 6 again
    for step in (5, 6):
        a, b = exported(straight, step), exported(crashed, step)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    assert crashed.stable_steps("checkpoints") == [4, 6] and crashed.stable_steps("weights") == [4, 5, 6]


def test_a_rerun_removes_the_weights_of_the_steps_it_has_not_reached_yet(make_config):
    """Checkpoint 5, weights 5..8 from before a crash: re-running step 6 must not leave 7 and 8 (stale)
    nor prune the fresh weights/6 that step 7 samples with."""
    config = make_config("stale", micro_batch_tokens=256)
    config.steps, config.ckpt.keep, config.ckpt.interval = 10, 2, 5
    store = storage_for(config)
    for step in (5, 6, 7, 8):
        store.fs.makedirs(store.path("weights", step_name(step)), exist_ok=True)
        store.mark_stable(store.path("weights", step_name(step)))
    store.fs.makedirs(checkpoint.checkpoint_dir(store, 5))
    store.mark_stable(checkpoint.checkpoint_dir(store, 5))
    config.ckpt.keep_weights_every = 0
    checkpoint.prune(store, 6, config)
    assert store.stable_steps("weights") == [5, 6] and store.stable_steps("checkpoints") == [5]


def test_a_background_save_writes_the_state_of_its_step_while_training_goes_on(make_config):
    config = make_config("background")
    store = storage_for(config)
    trainer = Trainer(config, store)
    trainer.optimizer_step(1, make_batch(101))
    at_step_1 = {name: p.detach().clone() for name, p in trainer.module.named_parameters()}
    moments = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    directory = trainer.save_checkpoint(1, {"step": 1}, background=True)
    trainer.optimizer_step(2, make_batch(102))  # changes the parameters and AdamW moments in place
    checkpoint.WRITER.wait()
    assert store.is_stable(directory) and checkpoint.load_part(store, 1, "extra_state") == {"step": 1}
    saved = checkpoint.load_part(store, 1, "model")
    assert all(torch.equal(saved[name], value) for name, value in at_step_1.items())
    saved_moments = next(iter(checkpoint.load_part(store, 1, "optimizer")["state"].values()))
    assert all(torch.equal(saved_moments[k], v) for k, v in moments.items())


def test_a_failed_background_write_leaves_no_stable_marker_and_is_raised_by_the_next_save(make_config, monkeypatch):
    config = make_config("failed")
    store = storage_for(config)
    trainer = Trainer(config, store)
    trainer.optimizer_step(1, make_batch(101))

    def full_disk(obj, file):
        file.write(b"half written")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    trainer.save_checkpoint(1, {}, background=True)
    with pytest.raises(StorageFullError, match="No space left"):
        trainer.save_checkpoint(2, {})
    assert store.stable_steps("checkpoints") == []
    assert not store.exists(checkpoint.checkpoint_dir(store, 1))  # the partial write does not hold the room
    checkpoint.WRITER.wait()  # the error was raised once


def test_prune_keeps_the_checkpoint_being_written(make_config, monkeypatch):
    config = make_config("writing")
    config.ckpt.keep, config.ckpt.interval = 1, 2
    store = storage_for(config)
    started, release = threading.Event(), threading.Event()
    real_save = checkpoint.save_checkpoint

    def slow_save(storage, step, parts):
        storage.fs.makedirs(checkpoint.checkpoint_dir(storage, step), exist_ok=True)  # half written
        started.set()
        release.wait(30)
        return real_save(storage, step, parts)

    monkeypatch.setattr(checkpoint, "save_checkpoint", slow_save)
    trainer = Trainer(config, store)
    trainer.optimizer_step(2, make_batch(102))
    trainer.save_checkpoint(2, {}, background=True)
    started.wait(30)
    checkpoint.prune(store, 3, config)  # step 3 has no checkpoint: an unfinished older one would be removed
    assert store.exists(checkpoint.checkpoint_dir(store, 2))
    release.set()
    checkpoint.WRITER.wait()
    assert store.stable_steps("checkpoints") == [2]


@pytest.mark.parametrize("bad", [{"interval": 0}, {"keep": 0}])
def test_bad_ckpt_values_are_refused_naming_the_key(make_config, bad):
    from trace_rl.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=f"ckpt.{next(iter(bad))}"):
        parse_config({"name": "x", "env": [{"id": "reverse-text"}], "ckpt": bad})
