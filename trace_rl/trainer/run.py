"""Train one step given the config, the run storage and the step, in-process or as torchrun workers.

`train_one_step` is what the pipeline calls. With `trainer.num_processes == 1` (and no
`trainer.cpu_offload`) it trains in this process (reusing a warm `Trainer` if given); otherwise it hands the
step to torchrun workers (`trace_rl.trainer.workers`, kept up across steps), whose ranks
train on `steps/<step>/batch.parquet` and write the checkpoint and the weights (rank 0
writes). Either way, on return `weights/<step>/` is STABLE, and so is
`checkpoints/<step>/` when `ckpt.interval` gives the step one, except in-process before the run's last
step: that checkpoint is being written in the background (`checkpoint.WRITER`).
"""

from __future__ import annotations

from typing import Any

from trace_rl.config import Config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_batch


class TrainerError(RuntimeError):
    pass


def check_resumes_at(restored: int | None, step: int) -> None:
    """A step trains on top of the previous step's checkpoint (or the base model at the first step)."""
    if restored is not None and restored >= step:
        raise TrainerError(
            f"checkpoint for step {restored} already exists; step {step} would train on top of a later state. "
            f"Delete the newer checkpoints or resume from step {restored + 1}"
        )


def train_in_process(trainer, storage: RunStorage, step: int, extra_state: dict[str, Any] | None) -> dict[str, float]:
    """Train the step; write its checkpoint if `ckpt.interval` says so, its weights, then prune old ones.

    A single process writes the checkpoint in the background but at the run's last step (it is STABLE later,
    as a step between `ckpt.interval`s has none: a crash before then resumes from the one before); torchrun
    ranks write it before they answer."""
    from trace_rl.trainer.checkpoint import prune, writes_checkpoint

    metrics = trainer.train_step(step, read_batch(storage, step))
    if writes_checkpoint(trainer.config, step):
        trainer.save_checkpoint(step, extra_state, background=not trainer.distributed and step < trainer.config.steps)
    trainer.export_weights(step)
    if trainer.rank == 0:
        prune(storage, step, trainer.config)
    return metrics


def train_one_step(
    config: Config,
    storage: RunStorage,
    step: int,
    trainer=None,
    extra_state: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Train on step `step`'s batch, checkpoint (with `extra_state`) and export weights; returns the step metrics.

    In-process, a given `trainer` is used as is (the caller keeps it warm between
    steps); without one, a new Trainer restores the latest checkpoint first, and the step's checkpoint is
    STABLE on return. With
    `config.trainer.uses_workers`, `trainer` is the run's `TrainerWorkers` (kept up between steps);
    without one, workers are started for this step alone.
    """
    if config.trainer.uses_workers:
        from trace_rl.trainer.workers import TrainerWorkers

        if isinstance(trainer, TrainerWorkers):  # the run's persistent workers
            return trainer.train(step, extra_state)
        with TrainerWorkers(config, storage) as workers:
            return workers.train(step, extra_state)
    if trainer is not None:
        return train_in_process(trainer, storage, step, extra_state)
    from trace_rl.trainer.checkpoint import WRITER
    from trace_rl.trainer.trainer import Trainer

    trainer = Trainer(config, storage)
    restored, _ = trainer.restore()
    check_resumes_at(restored, step)
    metrics = train_in_process(trainer, storage, step, extra_state)
    WRITER.wait()  # a trainer for this step alone: no later step overlaps its checkpoint write
    return metrics
