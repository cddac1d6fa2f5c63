"""`trace-rl export-traces RUN --steps A:B --out FILE`: a run's saved traces as verifiers v1 trace records.

Each trace of each chosen step becomes one record (trace_rl.verifiers.convert.record_from_trace) that
`vf.WireTrace` reads back with the same branches, token ids, sampled mask and logprobs (every digit: JSON
numbers hold a float32 exactly); the step is recorded with it, so `trace-rl replay --traces FILE` replays the
same steps. JSON lines, or a msgpack stream when FILE ends in `.msgpack`.
"""

from __future__ import annotations

from typing import Any

import fsspec

from trace_rl.errors import RefusedError
from trace_rl.offline.replay import parse_steps, saved_steps, source_config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_traces
from trace_rl.verifiers.extra import require_verifiers


def export_traces(run: str, out: str, steps: str | None = None, overwrite: bool = False,
                  storage_options: dict[str, Any] | None = None) -> tuple[int, list[int]]:
    """Write the traces of `steps` (FIRST:LAST, default every saved step) of the run at `run` to `out`: (records
    written, steps). Refused in one line without verifiers, or when `out` exists and `overwrite` is not set."""
    require_verifiers("export-traces")
    config = source_config(run, storage_options, flag="RUN")
    storage = RunStorage.from_url(run, storage_options)
    chosen = parse_steps(steps, saved_steps(storage))
    if not chosen:
        raise RefusedError(f"RUN {run}: the run has no saved traces to export")
    fs, path = fsspec.core.url_to_fs(out, **(storage_options or {}))
    if fs.exists(path) and not overwrite:
        raise RefusedError(f"--out {out} exists; choose another file or pass --overwrite to replace it")
    from trace_rl.verifiers.records import write_records

    count = write_records(out, {step: read_traces(storage, step) for step in chosen}, model=config.model.name,
                          storage_options=storage_options)
    return count, chosen
