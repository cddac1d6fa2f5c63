"""Checking a safetensors weights directory before a sampler loads it.

A reload that fails half-way would leave a sampler on a mix of old and new weights (and
a failed `reload_weights` RPC takes a vLLM engine down with it), so every runtime first
checks that the new directory holds exactly the tensors it expects: names and shapes,
read from the safetensors headers without loading the data.
"""

from __future__ import annotations

import glob
import os


def safetensors_files(local_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(local_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {local_dir}")
    return files


def tensor_shapes(local_dir: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a directory's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(local_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_weights(
    local_dir: str, expected: dict[str, tuple[int, ...]] | None, optional: set[str] = frozenset({"lm_head.weight"})
) -> None:
    """Raise unless `local_dir` holds the expected tensors (names in `optional`, tied ones, may be absent)."""
    found = tensor_shapes(local_dir)
    if expected is None:
        return
    unknown = sorted(set(found) - set(expected))
    missing = sorted(set(expected) - set(found) - set(optional))
    mismatched = sorted(f"{k} {found[k]} != {expected[k]}" for k in found.keys() & expected.keys() if found[k] != expected[k])
    if unknown or missing or mismatched:
        problems = [f"{label}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                    for label, items in (("unknown tensors", unknown), ("missing tensors", missing),
                                         ("shape mismatch", mismatched)) if items]
        raise ValueError(f"weights in {local_dir} do not fit the model ({'; '.join(problems)})")


def local_tensor_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """The tensor shapes of a local model directory; None for a hub id (then only file presence is checked)."""
    return tensor_shapes(model_path) if os.path.isdir(model_path) else None
