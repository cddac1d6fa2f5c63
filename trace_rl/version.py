"""trace-rl's version, and which run directories it reads.

Every run directory records the trace-rl that started it in `trace-rl.json` (`{"version": "0.2.0"}`). `--resume`
and `replay` read only runs of this release's `major.minor`: tables, checkpoints and config keys may change between
releases (CHANGELOG.md), and trace-rl keeps no converters for older layouts. A run without the file was written by
trace-rl 0.1, which did not record one.
"""

from __future__ import annotations

import json

VERSION = "0.2.0"
VERSION_FILE = "trace-rl.json"
UNRECORDED = "0.1"  # what a run directory without VERSION_FILE was written by


def release(version: str) -> str:
    """`major.minor` of a version string: the part that decides whether a run directory can be read."""
    return ".".join(version.split(".")[:2])


def version_record() -> bytes:
    return json.dumps({"version": VERSION}).encode()


def unreadable_version(recorded: bytes | None) -> str | None:
    """The version that wrote a run directory (its VERSION_FILE's bytes, None: no file), when this trace-rl cannot
    read it; None when it can."""
    version = UNRECORDED if recorded is None else str(json.loads(recorded).get("version", UNRECORDED))
    return None if release(version) == release(VERSION) else version
