"""The one owner of a run's trainer: built, restored, checked, trained a step at a time, stopped.

`RunTrainer` is what training (the pipeline's `train` stage, through the session), replay's `--train` and the
session use. With `trainer.uses_workers` (num_processes > 1, or `trainer.cpu_offload`) it hands each step to the
run's torchrun workers (`trace_rl.trainer.launcher`, kept up across steps), whose ranks build their trainer with
`restore_trainer` too and train on `steps/<step>/batch.parquet`, writing the checkpoint and the weights (rank 0
writes). Otherwise it trains in this process, on a `Trainer` kept warm between steps. Either way, once a step
returns `weights/<step>/` is STABLE, and so is `checkpoints/<step>/` when `ckpt.interval` gives the step one,
except in-process before the run's last step: that checkpoint is written in the background
(`checkpoint.WRITER`) while the next step runs, and `stop` (or `finish_checkpoint_write`) waits for it.
"""

from __future__ import annotations

from typing import Any, Self

from trace_rl.config import Config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_batch
from trace_rl.trainer.resume import check_resumes_at


def restore_trainer(config: Config, storage: RunStorage):
    """A `Trainer` built in this process with the latest checkpoint restored: (trainer, the checkpoint's step or
    None)."""
    from trace_rl.models.runtime import TORCH_STATE_LOCK
    from trace_rl.trainer.trainer import Trainer

    with TORCH_STATE_LOCK:
        trainer = Trainer(config, storage)
        restored, _ = trainer.restore()
    return trainer, restored


def train_in_process(trainer, storage: RunStorage, step: int, extra_state: dict[str, Any] | None) -> dict[str, float]:
    """Train the step; write its checkpoint if `ckpt.interval` says so, its weights, then prune old ones.

    A single process writes the checkpoint in the background but at the run's last step (it is STABLE later,
    as a step between `ckpt.interval`s has none: a crash before then resumes from the one before); torchrun
    ranks write it before they answer."""
    from trace_rl.trainer.checkpoint import prune, writes_checkpoint

    metrics = trainer.optimizer_step(step, read_batch(storage, step))
    if writes_checkpoint(trainer.config, step):
        trainer.save_checkpoint(step, extra_state, background=not trainer.distributed and step < trainer.config.steps)
    trainer.export_weights(step)
    if trainer.rank == 0:
        prune(storage, step, trainer.config)
    return metrics


class RunTrainer:
    """The trainer of one run, from the first step it trains to `stop`: the run's torchrun workers, or a Trainer in
    this process restored from the latest checkpoint (again whenever the step to train does not follow the one it
    trained last: a re-run after a resume)."""

    def __init__(self, config: Config, storage: RunStorage):
        self.config = config
        self.storage = storage
        self._trainer = None  # the in-process Trainer or the TrainerWorkers, once built
        self._trained: int | None = None  # the last step the in-process Trainer trained

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._trainer is not None and not self.config.trainer.uses_workers:
            from trace_rl.trainer.checkpoint import WRITER

            WRITER.wait()  # the error of a failed background write of a step this block trained is raised here

    def at(self, step: int):
        """The trainer that trains `step`: the run's `TrainerWorkers` (they restore or restart themselves and check
        the step), or the in-process Trainer holding the state after step `step - 1`."""
        if self.config.trainer.uses_workers:
            if self._trainer is None:
                from trace_rl.trainer.launcher import TrainerWorkers

                self._trainer = TrainerWorkers(self.config, self.storage)
            return self._trainer
        if self._trainer is None or self._trained != step - 1:
            self._trainer, self._trained = None, None
            trainer, restored = restore_trainer(self.config, self.storage)
            check_resumes_at(restored, step)
            self._trainer = trainer
        return self._trainer

    def run_step(self, step: int, extra_state: dict[str, Any] | None = None) -> dict[str, float]:
        """Train step `step` on its batch, checkpoint (with `extra_state`) and export its weights; the step's
        metrics."""
        trainer = self.at(step)
        if self.config.trainer.uses_workers:
            return trainer.run_step(step, extra_state)
        metrics = train_in_process(trainer, self.storage, step, extra_state)
        self._trained = step
        return metrics

    def run_steps(self, steps: list[int]) -> list[dict[str, float]]:
        """One optimizer step per batch of `steps`, in order, on one trainer from the latest checkpoint: a replay's
        steps, which need not follow each other."""
        if self.config.trainer.uses_workers:
            return [self.run_step(step) for step in steps]
        self._trainer, _ = restore_trainer(self.config, self.storage)
        return [train_in_process(self._trainer, self.storage, step, None) for step in steps]

    def export_weights(self, step: int) -> None:
        """Export `weights/<step>` from the latest checkpoint (that of `step`), in this process."""
        trainer, _ = restore_trainer(self.config, self.storage)
        trainer.export_weights(step)

    def finish_checkpoint_write(self) -> None:
        """Return once the checkpoint the in-process trainer writes in the background is written (the error of a
        write that failed is raised by the trainer's next save or restore)."""
        if self._trainer is not None and not self.config.trainer.uses_workers:
            from trace_rl.trainer.checkpoint import WRITER

            WRITER.join()

    def stop(self) -> None:
        """Stop the run's torchrun workers, or wait for the in-process trainer's background checkpoint write."""
        if self.config.trainer.uses_workers:
            if self._trainer is not None:
                self._trainer.stop()
        else:
            self.finish_checkpoint_write()


def train_one_step(config: Config, storage: RunStorage, step: int, trainer=None,
                   extra_state: dict[str, Any] | None = None) -> dict[str, float]:
    """Train on step `step`'s batch, checkpoint (with `extra_state`) and export weights; returns the step metrics.

    A given `trainer` (an in-process Trainer, or a run's `TrainerWorkers`) is used as is: its owner keeps it
    between steps. Without one, a `RunTrainer` trains this step alone (a new Trainer restores the latest checkpoint,
    or workers are started) and stops: the step's checkpoint is STABLE on return.
    """
    if trainer is None:
        with RunTrainer(config, storage) as owner:
            return owner.run_step(step, extra_state)
    from trace_rl.trainer.launcher import TrainerWorkers

    if isinstance(trainer, TrainerWorkers):
        return trainer.run_step(step, extra_state)
    return train_in_process(trainer, storage, step, extra_state)
