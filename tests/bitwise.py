"""Bitwise comparisons of files and of runs whose failure says where they part, in a line: a failed `assert a == b`
on bytes prints both in full (1.7 MB for the tiny model's weights), and in CI, where pytest truncates nothing, it
does so on the short summary's line, which then hides the name of the test that failed."""

from __future__ import annotations

import io

import torch

from trace_rl.storage import RunStorage

SHOWN = 4  # differing tensors named in a message


def difference(left: bytes, right: bytes) -> str | None:
    """None when `left` and `right` are the same bytes; else how they differ. For two safetensors files: the tensors
    that differ, each with how many of its values do and by how much at most; for other files: their sizes and the
    first byte that differs."""
    if left == right:
        return None
    tensors = safetensors_or_none(left), safetensors_or_none(right)
    if None in tensors:
        first = next((i for i, (a, b) in enumerate(zip(left, right)) if a != b), min(len(left), len(right)))
        return f"{len(left)} against {len(right)} bytes, the first difference at byte {first}"
    a, b = tensors
    if a.keys() != b.keys():
        return f"other tensors: {sorted(a.keys() ^ b.keys())[:SHOWN]}"
    parts = []
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            parts.append(f"{name} {x.dtype}{list(x.shape)} against {y.dtype}{list(y.shape)}")
        elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            differ = int((x != y).sum())  # by value: 0.0 and -0.0 are the same value in other bytes
            largest = float((x.double() - y.double()).abs().max())
            parts.append(f"{name} in {differ} of {x.numel()} values (by up to {largest:.3g})")
    named = "; ".join(parts[:SHOWN]) + (f"; and {len(parts) - SHOWN} more" if len(parts) > SHOWN else "")
    return f"{len(parts)} of {len(a)} tensors differ: {named}" if parts else "the same tensors, other file bytes"


def safetensors_or_none(data: bytes) -> dict[str, torch.Tensor] | None:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, ValueError, TypeError):
        return None


def weights_bytes(storage: RunStorage, step: int) -> bytes:
    """The safetensors of the weights a run exported after `step`, read through its storage (any fsspec URL)."""
    return storage.read_bytes(storage.path("weights", f"{step:06d}", "model.safetensors"))


def weights_difference(run: RunStorage, reference: RunStorage, step: int | None = None) -> str | None:
    """None when the weights `run` and `reference` exported after `step` (None: `run`'s newest) are the same bytes;
    else where `run` first parts from `reference`: the first step whose weights differ and in which tensors, whether
    its batch does, and both runs' training metrics of that step (what tells a different batch from the same batch
    trained differently)."""
    import pyarrow.parquet as pq

    step = run.stable_steps("weights")[-1] if step is None else step
    if weights_bytes(run, step) == weights_bytes(reference, step):
        return None

    def trained(storage: RunStorage, step: int) -> dict:
        metrics = storage.read_json(storage.step_path(step, "train_metrics.json"))
        return {key: metrics.get(key) for key in ("loss", "grad_norm", "entropy", "mismatch/mean_abs_logprob_diff")}

    def batch(storage: RunStorage, step: int):
        path = storage.step_path(step, "batch.parquet")
        return pq.read_table(io.BytesIO(storage.read_bytes(path))) if storage.exists(path) else None

    def differ(s: int) -> bool:
        kept = all(storage.is_stable(storage.path("weights", f"{s:06d}")) for storage in (run, reference))
        return kept and weights_bytes(run, s) != weights_bytes(reference, s)

    first = next(s for s in range(1, step + 1) if s == step or differ(s))
    here, there = batch(run, first), batch(reference, first)
    same = "unknown" if here is None or there is None else "the same" if here.equals(there) else "different"
    tensors = difference(weights_bytes(run, first), weights_bytes(reference, first))
    return (f"the weights of step {first} differ first ({tensors}); its batch is {same}; trained here: "
            f"{trained(run, first)}, in the reference: {trained(reference, first)}")
