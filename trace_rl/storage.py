"""Run storage over fsspec: a local path, file://, memory:// or s3:// alike.

Layout under `<storage>/<name>/` (see docs/storage.md):

    config.toml
    steps/<step:06d>/traces.parquet | batch.parquet | metrics.json
    checkpoints/<step:06d>/...  + STABLE
    weights/<step:06d>/...      + STABLE

Nothing half-written is ever read as complete. Single files are written to a
temporary name and renamed into place (atomic on a local disk and in memory; on
S3 the rename is a server-side copy, whose object appears only once complete).
Directories get a `STABLE` marker written last; readers ignore unmarked ones.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Callable
from typing import Any

import fsspec

STABLE = "STABLE"


def step_name(step: int) -> str:
    return f"{step:06d}"


class RunStorage:
    """The storage of one run, rooted at `<storage>/<name>`."""

    def __init__(self, storage: str, name: str, storage_options: dict[str, Any] | None = None):
        self.storage = storage
        self.name = name
        self.storage_options = dict(storage_options or {})
        self.fs, base = fsspec.core.url_to_fs(storage, **self.storage_options)
        self.root = f"{base.rstrip('/')}/{name}"
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    @classmethod
    def from_url(cls, run_url: str, storage_options: dict[str, Any] | None = None) -> RunStorage:
        """Open an existing run given its full URL `<storage>/<name>`."""
        storage, _, name = run_url.rstrip("/").rpartition("/")
        return cls(storage or ".", name, storage_options)

    @property
    def url(self) -> str:
        """The run's URL, as a user would type it."""
        return self.root if self.protocol in ("file", "local") else f"{self.protocol}://{self.root}"

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        path = self.path(*parts)
        return path if self.protocol in ("file", "local") else f"{self.protocol}://{path}"

    def step_path(self, step: int, filename: str) -> str:
        return self.path("steps", step_name(step), filename)

    # -- whole files -------------------------------------------------------------
    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def write_atomic(self, path: str, write: Callable[[io.IOBase], None] | bytes) -> None:
        """Write a file so that readers see either nothing or all of it."""
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}-{path.rsplit('/', 1)[1]}"
        try:
            with self.fs.open(tmp, "wb") as f:
                if isinstance(write, bytes):
                    f.write(write)
                else:
                    write(f)
            self.fs.mv(tmp, path)
        finally:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def write_json(self, path: str, data: Any) -> None:
        self.write_atomic(path, json.dumps(data, indent=2, sort_keys=True).encode())

    def read_json(self, path: str) -> Any:
        return json.loads(self.read_bytes(path))

    # -- directories with a STABLE marker -------------------------------------------
    def mark_stable(self, directory: str) -> None:
        self.write_atomic(f"{directory}/{STABLE}", b"")

    def is_stable(self, directory: str) -> bool:
        return self.fs.exists(f"{directory}/{STABLE}")

    def stable_steps(self, kind: str) -> list[int]:
        """Steps under `checkpoints` or `weights` whose STABLE marker exists, ascending."""
        base = self.path(kind)
        if not self.fs.exists(base):
            return []
        steps = []
        for entry in self.fs.ls(base, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.isdigit() and self.is_stable(f"{base}/{name}"):
                steps.append(int(name))
        return sorted(steps)

    def latest_stable(self, kind: str) -> int | None:
        steps = self.stable_steps(kind)
        return steps[-1] if steps else None

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def upload_dir(self, local_dir: str, directory: str) -> None:
        """Copy a local directory's files into `directory`, then mark it STABLE."""
        import os

        self.remove(directory)
        self.fs.makedirs(directory, exist_ok=True)
        for root, _, files in os.walk(local_dir):
            for filename in sorted(files):
                local = os.path.join(root, filename)
                rel = os.path.relpath(local, local_dir).replace(os.sep, "/")
                target = f"{directory}/{rel}"
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(local, target)
        self.mark_stable(directory)

    def download_dir(self, directory: str, local_dir: str) -> None:
        """Copy a STABLE directory's files (not the marker) to a local directory."""
        import os

        if not self.is_stable(directory):
            raise FileNotFoundError(f"{directory} is not complete (no {STABLE} marker)")
        os.makedirs(local_dir, exist_ok=True)
        for path in self.fs.find(directory):
            rel = path[len(directory.rstrip("/")) + 1 :]
            if rel == STABLE:
                continue
            target = os.path.join(local_dir, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self.fs.get_file(path, target)
