"""Training checkpoints at `checkpoints/<step:06d>/`, marked STABLE only once every part is written.

A checkpoint holds one torch file per part:

    model.pt        full model state dict (parameter names without DDP/FSDP wrappers)
    optimizer.pt    full optimizer state dict keyed by parameter name
    trainer.pt      step, LR scheduler state, RNG states (python, numpy, torch, cuda)
    extra_state.pt  state of stateful algorithms (e.g. rae), as given by the pipeline

Parts are written through `RunStorage.staged_dir` (into the checkpoint's directory on a local disk, else
into a local folder then uploaded), which writes the STABLE marker after the last file; a reader only ever
sees complete checkpoints. A checkpoint is written every `ckpt.interval`-th step
(weights every step); `prune` keeps the last `ckpt.keep` of each, and the weights of every
`ckpt.keep_weights_every`-th step.

`WRITER` writes a checkpoint in the background (`Trainer.save_checkpoint(background=True)`, what the
in-process trainer does at every step but the run's last): one thread writes the parts and marks them
STABLE, one checkpoint at a time, while the caller goes on. The tensors are written as they are, not
copied (a copy of a 135M-parameter model's state is 1.6 GB more memory): the caller changes none of them
until `wait()` returns (the Trainer waits before its next optimizer step). The next save, a restore and
the end of the process wait for it too; a process killed mid-write leaves no STABLE marker, as a
synchronous save killed mid-write does.
"""

from __future__ import annotations

import io
import os
import random
import threading
import time
from typing import Any

import numpy as np
import torch

from trace_rl.config import Config
from trace_rl.storage import RunStorage, step_name

KIND = "checkpoints"
WEIGHTS = "weights"
PARTS = ("model", "optimizer", "trainer", "extra_state")


def checkpoint_dir(storage: RunStorage, step: int) -> str:
    return storage.path(KIND, step_name(step))


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def writes_checkpoint(config: Config, step: int) -> bool:
    """A full checkpoint is written every `ckpt.interval`-th step and at the run's last step."""
    return step % config.ckpt.interval == 0 or step == config.steps


def save_checkpoint(storage: RunStorage, step: int, parts: dict[str, Any]) -> str:
    """Write the parts and mark the checkpoint STABLE. Returns its directory."""
    missing = set(PARTS) - set(parts)
    if missing:
        raise ValueError(f"checkpoint for step {step} lacks parts {sorted(missing)}")
    directory = checkpoint_dir(storage, step)
    with storage.staged_dir(directory) as staging:
        for name in PARTS:
            # through a Python file: a full disk then raises the OSError (ENOSPC) that names it, where torch's own
            # writer raises an iostream error that does not
            with open(os.path.join(staging, f"{name}.pt"), "wb") as f:
                torch.save(parts[name], f)
                f.flush()
                os.fsync(f.fileno())
    return directory


class CheckpointWriter:
    """This process's checkpoint write in the background: at most one at a time."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._writing: tuple[str, int] | None = None  # (run storage URL, step) while a write is under way
        self._error: BaseException | None = None
        self.last_write_seconds: float | None = None  # how long the last background write took (benchmarks)

    def start(self, storage: RunStorage, step: int, parts: dict[str, Any]) -> str:
        """Wait for the write under way, then write `parts` in a thread; nothing in them may change until `wait()`
        returns."""
        self.wait()
        self._writing = (storage.url, step)
        # not a daemon: a process that ends normally waits for the write; a killed one leaves no STABLE
        self._thread = threading.Thread(target=self._write, args=(storage, step, parts), name=f"checkpoint-{step}")
        self._thread.start()
        return checkpoint_dir(storage, step)

    def _write(self, storage: RunStorage, step: int, parts: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            save_checkpoint(storage, step, parts)
        except BaseException as exc:  # raised by the next wait(), in the training thread
            self._error = exc
        self.last_write_seconds = time.perf_counter() - started

    def join(self) -> None:
        """Return once no write is under way (the error of one that failed is kept for `wait`)."""
        if self._thread is not None:
            self._thread.join()
            self._thread, self._writing = None, None

    def wait(self) -> None:
        """Return once no write is under way; raise the error of a write that failed."""
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def writing(self, storage: RunStorage) -> int | None:
        """The step of `storage`'s run whose checkpoint is being written, if any."""
        if self._writing is not None and self._writing[0] == storage.url and self._thread.is_alive():
            return self._writing[1]
        return None


WRITER = CheckpointWriter()


def load_part(storage: RunStorage, step: int, name: str) -> Any:
    data = storage.read_bytes(f"{checkpoint_dir(storage, step)}/{name}.pt")
    # extra_state holds whatever the algorithms keep (numpy arrays, dataclasses): it is the run's own file
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=name != "extra_state")


def kept_steps(checkpoints: list[int], weights: list[int], keep: int, lag: int = 0,
               weights_every: int = 0) -> tuple[set[int], set[int]]:
    """(checkpoint steps, weights steps) to keep: the last `keep` of each, plus the weights the steps after a
    kept checkpoint sample with, plus the weights of every `weights_every`-th step (0: none more). Step `s`
    samples with `weights/<s - 1 - lag>` (`lag`: `[async] max_off_policy_steps`), so a resume from checkpoint `c`
    needs `weights/<c - lag>` .. `weights/<c>`, and the steps still to come need the last `keep + lag` weights."""
    kept_checkpoints = set(sorted(checkpoints)[-keep:])
    resumable = {w for w in weights if any(c - lag <= w <= c for c in kept_checkpoints)}
    every = {w for w in weights if weights_every and w % weights_every == 0}
    return kept_checkpoints, set(sorted(weights)[-(keep + lag):]) | resumable | every


def prune(storage: RunStorage, current: int, config: Config) -> None:
    """After step `current`: remove the stable checkpoints and weights `[ckpt]` does not keep, unfinished ones older
    than `current`, and any later than it (left by the run before a resume re-ran the steps after its checkpoint).
    The checkpoint `WRITER` is writing stays."""
    writing = WRITER.writing(storage)
    stable = {kind: [s for s in storage.stable_steps(kind) if s <= current] for kind in (KIND, WEIGHTS)}
    kept = dict(zip((KIND, WEIGHTS), kept_steps(stable[KIND], stable[WEIGHTS], config.ckpt.keep,
                                                 config.async_.max_off_policy_steps, config.ckpt.keep_weights_every)))
    for kind in (KIND, WEIGHTS):
        base = storage.path(kind)
        if not storage.exists(base):
            continue
        for entry in storage.fs.ls(base, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if not name.isdigit():
                continue
            step = int(name)
            if kind == KIND and step == writing:
                continue
            if step > current or step not in kept[kind] and (step in stable[kind] or step < current):
                storage.remove(f"{base}/{name}")
