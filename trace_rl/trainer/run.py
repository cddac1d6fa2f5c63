"""Train one step given the config, the run storage and the step, in-process or as torchrun workers.

`train_one_step` is what the pipeline calls. With `trainer.num_processes == 1` it
trains in this process (reusing a warm `Trainer` if given); otherwise it launches
`python -m torch.distributed.run` with `trace_rl.trainer.worker`, whose ranks each
restore the latest checkpoint, train on `steps/<step>/batch.parquet`, and write the
checkpoint and the weights (rank 0 writes). Either way, on return
`checkpoints/<step>/` and `weights/<step>/` are STABLE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from trace_rl.config import Config
from trace_rl.credentials import REVEAL
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
    """Train the step; write its checkpoint if `ckpt.interval` says so, its weights, then prune old ones."""
    from trace_rl.trainer.checkpoint import prune, writes_checkpoint

    metrics = trainer.train_step(step, read_batch(storage, step))
    if writes_checkpoint(trainer.config, step):
        trainer.save_checkpoint(step, extra_state)
    trainer.export_weights(step)
    if trainer.rank == 0:
        prune(storage, step, trainer.config.ckpt.keep)
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
    steps); without one, a new Trainer restores the latest checkpoint first.
    """
    if config.trainer.num_processes > 1:
        return launch_workers(config, step, extra_state)
    if trainer is None:
        from trace_rl.trainer.trainer import Trainer

        trainer = Trainer(config, storage)
        restored, _ = trainer.restore()
        check_resumes_at(restored, step)
    return train_in_process(trainer, storage, step, extra_state)


def launch_workers(config: Config, step: int, extra_state: dict[str, Any] | None) -> dict[str, float]:
    """Run `trainer.num_processes` torchrun workers for one step and return rank 0's metrics."""
    import torch

    with tempfile.TemporaryDirectory(prefix="trace-rl-workers-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        extra_path = os.path.join(tmp, "extra_state.pt")
        metrics_path = os.path.join(tmp, "metrics.json")
        with open(config_path, "w") as f:  # a private temporary directory: the workers need the real credentials
            f.write(config.model_dump_json(context={REVEAL: True}))
        torch.save(dict(extra_state or {}), extra_path)
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(config.trainer.num_processes),
            "-m", "trace_rl.trainer.worker",
            "--config", config_path, "--step", str(step), "--extra-state", extra_path, "--metrics", metrics_path,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stdout + result.stderr)[-4000:]
            raise TrainerError(f"trainer workers failed at step {step} (exit {result.returncode}):\n{tail}")
        with open(metrics_path) as f:
            return json.load(f)
