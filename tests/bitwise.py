"""Bitwise comparisons of files whose failure says where they part, in a line: a failed `assert a == b` on bytes
prints both in full (1.7 MB for the tiny model's weights), and in CI, where pytest truncates nothing, it does so on
the short summary's line, which then hides the name of the test that failed."""

from __future__ import annotations

import torch

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
