"""Training checkpoints at `checkpoints/<step:06d>/`, marked STABLE only once every part is written.

A checkpoint holds one torch file per part:

    model.pt        full model state dict (parameter names without DDP/FSDP wrappers)
    optimizer.pt    full optimizer state dict keyed by parameter name
    trainer.pt      step, LR scheduler state, RNG states (python, numpy, torch, cuda)
    extra_state.pt  state of stateful algorithms (e.g. rae), as given by the pipeline

Parts are staged in a local directory and uploaded through `RunStorage`, whose
`upload_dir` writes the STABLE marker after the last file; a reader only ever
sees complete checkpoints.
"""

from __future__ import annotations

import io
import os
import random
import tempfile
from typing import Any

import numpy as np
import torch

from trace_rl.config import CheckpointConfig
from trace_rl.storage import RunStorage, step_name

KIND = "checkpoints"
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


def save_checkpoint(storage: RunStorage, step: int, parts: dict[str, Any], ckpt: CheckpointConfig) -> str:
    """Write the parts, mark the checkpoint STABLE, then prune old ones. Returns its directory."""
    missing = set(PARTS) - set(parts)
    if missing:
        raise ValueError(f"checkpoint for step {step} lacks parts {sorted(missing)}")
    directory = checkpoint_dir(storage, step)
    with tempfile.TemporaryDirectory(prefix="trace-rl-ckpt-") as staging:
        for name in PARTS:
            path = os.path.join(staging, f"{name}.pt")
            torch.save(parts[name], path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        storage.upload_dir(staging, directory)
    prune_checkpoints(storage, step, ckpt)
    return directory


def load_part(storage: RunStorage, step: int, name: str) -> Any:
    data = storage.read_bytes(f"{checkpoint_dir(storage, step)}/{name}.pt")
    # extra_state holds whatever the algorithms keep (numpy arrays, dataclasses): it is the run's own file
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=name != "extra_state")


def kept_steps(steps: list[int], ckpt: CheckpointConfig) -> set[int]:
    """The last `ckpt.keep` steps, plus every `ckpt.interval`-th one."""
    kept = set(sorted(steps)[-ckpt.keep :])
    if ckpt.interval:
        kept |= {s for s in steps if s % ckpt.interval == 0}
    return kept


def prune_checkpoints(storage: RunStorage, current: int, ckpt: CheckpointConfig) -> None:
    """Remove stable checkpoints not kept, and unfinished ones older than `current`."""
    stable = storage.stable_steps(KIND)
    kept = kept_steps(stable, ckpt)
    base = storage.path(KIND)
    for entry in storage.fs.ls(base, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if not name.isdigit():
            continue
        step = int(name)
        if (step in stable and step not in kept) or (step not in stable and step < current):
            storage.remove(f"{base}/{name}")
