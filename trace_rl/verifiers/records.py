"""Files of verifiers v1 trace records: what `trace-rl replay --traces` reads and `trace-rl export-traces` writes.

A records file is JSON lines, one record a line: a trace (`vf.Trace.to_record()`, with `task` and `nodes`) or an
episode (a line of verifiers' own `traces.jsonl`, with `task` and `traces`, each trace a record). A file whose
name ends in `.msgpack` holds the same records as a stream of msgpack objects. Each record becomes a trace-rl
trace (`trace_rl.verifiers.convert.trace_from_vf`) of one replay step: the step a trace-rl export recorded, else
the episode's training step (`run.work.step`), else step 1. The records of one task of one taskset (`task.type`,
or the episode's env id, and `task.data.idx`) form a group.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fsspec

from trace_rl.data.trace import Trace
from trace_rl.errors import RefusedError
from trace_rl.verifiers.convert import TRACE_RL_INFO, ConversionError, record_from_trace, trace_from_vf, untokenized
from trace_rl.verifiers.extra import require_verifiers

MSGPACK_SUFFIX = ".msgpack"
EXPECTED = ("expected one JSON object a line, each a vf.Trace.to_record() (with 'task' and 'nodes') or a line of "
            "verifiers' traces.jsonl (with 'task' and 'traces')")


class RecordsError(RefusedError):
    """A records file that cannot be replayed: the message names the file, the record and the fix."""


def read_records(path: str, storage_options: dict[str, Any] | None = None) -> dict[int, list[Trace]]:
    """The file's traces by replay step, in file order; RecordsError (one line) for a file that is missing or not
    verifiers records, a record without token ids (the first one named), or a trace id seen twice in a step."""
    require_verifiers(f"--traces {path}")
    from pydantic import ValidationError
    from verifiers.v1 import WireEpisode, WireTrace

    by_step: dict[int, list[Trace]] = {}
    seen: set[tuple[int, str]] = set()
    for where, data in _objects(path, storage_options):
        if not isinstance(data, dict) or "task" not in data or not ("nodes" in data or "traces" in data):
            raise RecordsError(f"{where}: not a verifiers v1 trace record; {EXPECTED}")
        try:
            if "traces" in data:
                episode = WireEpisode.model_validate({**data, "traces": []})
                vf_traces = [WireTrace.model_validate(trace) for trace in data["traces"]]
            else:
                episode, vf_traces = None, [WireTrace.model_validate(data)]
        except ValidationError as exc:
            first = exc.errors()[0]
            at = ".".join(str(part) for part in first["loc"]) or "the record"
            raise RecordsError(f"{where}: not a verifiers v1 trace record: {at}: {first['msg']}") from None
        for vf_trace in vf_traces:
            if untokenized(vf_trace):
                raise RecordsError(
                    f"{where}: trace {vf_trace.id} has sampled turns without token ids (sampled through an eval "
                    "client, which returns text only); replay trains on token ids: record the episodes through a "
                    "train client (verifiers' TrainClientConfig), or leave such records out")
            step = _step(vf_trace, episode)
            exported = TRACE_RL_INFO in vf_trace.info  # ids and policy step as trace-rl recorded them
            env = None if exported or episode is None else episode.env.id or None
            try:  # a foreign record was sampled by the weights its step trains from, as in a synchronous run
                trace = trace_from_vf(vf_trace, env=env, policy_step=None if exported else step - 1)
            except ConversionError as exc:
                raise RecordsError(f"{where}: {exc}") from None
            if (step, trace.id) in seen:
                raise RecordsError(f"{where}: trace id {trace.id!r} appears twice in step {step}; each record of a "
                                   "step needs its own trace id")
            seen.add((step, trace.id))
            by_step.setdefault(step, []).append(trace)
    if not by_step:
        raise RecordsError(f"{path} holds no records; {EXPECTED}")
    return by_step


def _step(vf_trace: Any, episode: Any) -> int:
    saved = vf_trace.info.get(TRACE_RL_INFO) or {}
    if "step" in saved:
        return int(saved["step"])
    work = getattr(getattr(episode, "run", None), "work", None)
    return work.step if work is not None and work.step > 0 else 1


def _objects(path: str, storage_options: dict[str, Any] | None) -> Iterator[tuple[str, Any]]:
    """(where, object) for every record of the file: `path line N` or `path record N`."""
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as file:
            raw = file.read()
    except FileNotFoundError:
        raise RecordsError(f"--traces {path}: no such file") from None
    if path.endswith(MSGPACK_SUFFIX):
        import msgpack

        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(raw)
        try:
            for number, data in enumerate(unpacker, 1):
                yield f"{path} record {number}", data
        except (msgpack.UnpackException, ValueError) as exc:
            raise RecordsError(f"{path}: not a msgpack stream of verifiers v1 trace records ({exc})") from None
        return
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise RecordsError(f"{path}: not text; {EXPECTED} (or name a msgpack stream *{MSGPACK_SUFFIX})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path} line {number}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecordsError(f"{path} line {number}: not JSON ({exc.msg}); {EXPECTED}") from None


def write_records(path: str, steps: dict[int, list[Trace]], *, model: str | None = None,
                  storage_options: dict[str, Any] | None = None) -> int:
    """Write the traces of each step as verifiers v1 trace records (JSON lines, or msgpack for a `.msgpack` path),
    every logprob digit kept; `model` is recorded as the agents' model. Returns how many records it wrote."""
    require_verifiers("export-traces")
    if path.endswith(MSGPACK_SUFFIX):
        import msgpack

        encode = msgpack.Packer().pack
    else:
        def encode(record: dict[str, Any]) -> bytes:
            return json.dumps(record).encode() + b"\n"
    count = 0
    with fsspec.open(path, "wb", **(storage_options or {})) as file:
        for step, traces in steps.items():
            for trace in traces:
                file.write(encode(record_from_trace(trace, model=model, step=step)))
                count += 1
    return count
