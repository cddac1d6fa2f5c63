"""Parquet tables: `traces.parquet` (one row per branch) and `batch.parquet` (one row per sample).

Both are plain Arrow types, readable as-is by pyarrow, pandas, polars and duckdb.
docs/storage.md documents every column.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trace_rl.data.channel import Channel
from trace_rl.data.sample import SAMPLE_ARRAYS, TrainingSample
from trace_rl.data.trace import ANNOTATIONS, POLICY_VERSIONS, TOKEN_ARRAYS, Branch, Trace
from trace_rl.names import LOSS_NAMES
from trace_rl.storage import RunStorage


MESSAGE_TYPE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("name", pa.string()), ("tool_call_id", pa.string()),
     ("tool_calls", pa.string())]
)
_ARROW = {np.int32: pa.int32(), np.bool_: pa.bool_(), np.float32: pa.float32()}

TRACE_SCHEMA = pa.schema(
    [
        ("trace_id", pa.string()),
        ("env", pa.string()),
        ("example_id", pa.string()),
        ("group_id", pa.string()),
        ("agent", pa.string()),
        ("trainable", pa.bool_()),
        ("reward", pa.float64()),
        ("rewards", pa.map_(pa.string(), pa.float64())),
        ("metrics", pa.map_(pa.string(), pa.float64())),
        ("info", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("error", pa.string()),
        ("policy_step", pa.int64()),
        ("num_branches", pa.int32()),
        ("branch_index", pa.int32()),
        ("temperature", pa.float64()),
        ("branch_trainable", pa.bool_()),
        *[(name, pa.list_(_ARROW[dtype])) for name, dtype in TOKEN_ARRAYS.items()],
        *[(name, pa.list_(_ARROW[dtype])) for name, dtype in ANNOTATIONS.items()],
        (POLICY_VERSIONS, pa.list_(pa.int32())),
    ]
)
BRANCH_ARRAYS = {**TOKEN_ARRAYS, **ANNOTATIONS, POLICY_VERSIONS: np.int32}  # the per-token columns of a branch row

BATCH_SCHEMA = pa.schema(
    [
        ("trace_id", pa.string()),
        ("branch_index", pa.int32()),
        ("env", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("temperature", pa.float32()),
        ("sampled", pa.list_(pa.bool_())),
        ("inference_logprobs", pa.list_(pa.float32())),
        *[col for loss in LOSS_NAMES for col in ((f"{loss}_values", pa.list_(pa.float32())),
                                                  (f"{loss}_mask", pa.list_(pa.bool_())))],
        ("ref_logprobs", pa.list_(pa.float32())),
        ("policy_versions", pa.list_(pa.int32())),
    ]
)
# the columns a batch table has only when its samples carry them: `ref_logprobs` (with [trainer.loss.kl]) and
# `policy_versions` (every batch the pipeline writes; samples built elsewhere may have none)
OPTIONAL_BATCH_COLUMNS = ("ref_logprobs", "policy_versions")


def _message_row(message) -> dict:
    row = message.model_dump()
    row["tool_calls"] = None if message.tool_calls is None else json.dumps(row["tool_calls"])
    return row


def list_column(arrays: list[np.ndarray | None], dtype) -> pa.ListArray:
    """A list<dtype> column from per-row numpy arrays (None: a null row), built from one buffer."""
    present = [a for a in arrays if a is not None]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([0 if a is None else len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(present).astype(dtype, copy=False) if present else np.empty(0, dtype)
    nulls = pa.array([a is None for a in arrays]) if len(present) < len(arrays) else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=_ARROW[dtype]), mask=nulls)


def traces_to_table(traces: list[Trace]) -> pa.Table:
    """One row per branch; a trace without branches (e.g. errored) keeps one row with null branch columns."""
    rows: dict[str, list] = {name: [] for name in TRACE_SCHEMA.names}
    for trace in traces:
        shared = {
            "trace_id": trace.id, "env": trace.env, "example_id": trace.example_id, "group_id": trace.group_id,
            "agent": trace.agent, "trainable": trace.trainable, "reward": trace.reward,
            "rewards": list(trace.rewards.items()), "metrics": list(trace.metrics.items()),
            "info": json.dumps(trace.info, sort_keys=True), "messages": [_message_row(m) for m in trace.messages],
            "error": trace.error, "policy_step": trace.policy_step, "num_branches": len(trace.branches),
        }
        for branch in trace.branches or [None]:
            for key, value in shared.items():
                rows[key].append(value)
            rows["branch_index"].append(None if branch is None else branch.index)
            rows["temperature"].append(None if branch is None else branch.temperature)
            rows["branch_trainable"].append(None if branch is None else branch.trainable)
            for name in BRANCH_ARRAYS:
                rows[name].append(None if branch is None else getattr(branch, name))
    for name, dtype in BRANCH_ARRAYS.items():
        rows[name] = list_column(rows[name], dtype)
    return pa.Table.from_pydict(rows, schema=TRACE_SCHEMA)


def _array(column: pa.ChunkedArray, row: int, dtype) -> np.ndarray | None:
    value = column[row]
    if not value.is_valid:
        return None
    return value.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def table_to_traces(table: pa.Table) -> list[Trace]:
    columns = {name: table.column(name) for name in table.column_names}
    traces: dict[str, Trace] = {}
    for row in range(table.num_rows):
        trace_id = columns["trace_id"][row].as_py()
        if trace_id not in traces:
            messages = []
            for m in columns["messages"][row].as_py():
                m = {k: v for k, v in m.items() if v is not None}
                if "tool_calls" in m:
                    m["tool_calls"] = json.loads(m["tool_calls"])
                messages.append(m)
            traces[trace_id] = Trace(
                id=trace_id,
                env=columns["env"][row].as_py(),
                example_id=columns["example_id"][row].as_py(),
                group_id=columns["group_id"][row].as_py(),
                agent=columns["agent"][row].as_py(),
                trainable=columns["trainable"][row].as_py(),
                reward=columns["reward"][row].as_py(),
                rewards=dict(columns["rewards"][row].as_py()),
                metrics=dict(columns["metrics"][row].as_py()),
                info=json.loads(columns["info"][row].as_py()),
                messages=messages,
                error=columns["error"][row].as_py(),
                policy_step=columns["policy_step"][row].as_py(),
            )
        index = columns["branch_index"][row].as_py()
        if index is None:
            continue
        arrays = {name: _array(columns[name], row, dtype) for name, dtype in BRANCH_ARRAYS.items()}
        branch = Branch(index=index, temperature=columns["temperature"][row].as_py(),
                        trainable=columns["branch_trainable"][row].as_py(), **arrays)
        traces[trace_id].branches.append(branch)
    return list(traces.values())


def samples_to_table(samples: list[TrainingSample]) -> pa.Table:
    """The batch table; `ref_logprobs` and `policy_versions` are columns only when the samples carry them (each
    all or none)."""
    schema = BATCH_SCHEMA
    for name in OPTIONAL_BATCH_COLUMNS:
        carried = [getattr(s, name) is not None for s in samples]
        if any(carried) and not all(carried):
            raise ValueError(f"{name}: every sample of a batch carries them, or none does")
        if not samples or not all(carried):
            schema = schema.remove(schema.get_field_index(name))
    rows = {
        name: (list_column([np.asarray(getattr(s, name)) for s in samples], SAMPLE_ARRAYS[name])
               if name in SAMPLE_ARRAYS else [getattr(s, name) for s in samples])
        for name in schema.names
    }
    return pa.Table.from_pydict(rows, schema=schema)


def table_to_samples(table: pa.Table) -> list[TrainingSample]:
    """The samples of a batch table."""
    columns = {name: table.column(name) for name in BATCH_SCHEMA.names if name in table.column_names}
    samples = []
    for row in range(table.num_rows):
        fields = {
            name: (_array(col, row, SAMPLE_ARRAYS[name]) if name in SAMPLE_ARRAYS else col[row].as_py())
            for name, col in columns.items()
        }
        samples.append(TrainingSample(**fields))
    return samples


class TableError(ValueError):
    """A Parquet file without a column its reader needs, or with a column of another type."""


def plain_type(type_: pa.DataType) -> pa.DataType:
    """`type_` with large strings, binaries and lists as the plain ones (what pandas or polars may write)."""
    if pa.types.is_large_string(type_):
        return pa.string()
    if pa.types.is_large_binary(type_):
        return pa.binary()
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return pa.list_(plain_type(type_.value_type))
    if pa.types.is_struct(type_):
        return pa.struct([field.with_type(plain_type(field.type)) for field in type_])
    if pa.types.is_map(type_):
        return pa.map_(plain_type(type_.key_type), plain_type(type_.item_type))
    return type_


def type_name(type_: pa.DataType) -> str:
    """`list<int32>` rather than pyarrow's `list<item: int32>` / `list<element: int32>` (names differ by writer)."""
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return f"{'large_' if pa.types.is_large_list(type_) else ''}list<{type_name(type_.value_type)}>"
    if pa.types.is_map(type_):
        return f"map<{type_name(type_.key_type)}, {type_name(type_.item_type)}>"
    return str(type_)


def check_columns(table: pa.Table, schema: pa.Schema, where: str, optional: tuple[str, ...] = ()) -> pa.Table:
    """`table` with each of `schema`'s columns of its type (large variants cast to the plain ones); else TableError
    naming the file `where` and the first missing or mistyped column. Other columns are left as they are."""
    for field in schema:
        if field.name not in table.column_names:
            if field.name in optional:
                continue
            raise TableError(f"{where}: column {field.name!r} ({type_name(field.type)}) is missing; docs/storage.md "
                             "lists the columns of every table")
        actual = table.schema.field(field.name).type
        if actual == field.type:
            continue
        if plain_type(actual) != field.type:
            raise TableError(f"{where}: column {field.name!r} has type {type_name(actual)}, expected "
                             f"{type_name(field.type)} (docs/storage.md)")
        index = table.column_names.index(field.name)
        table = table.set_column(index, field.name, table.column(field.name).cast(field.type))
    return table


def write_table(storage: RunStorage, path: str, table: pa.Table) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    storage.write_atomic(path, buffer.getvalue())


def read_table(storage: RunStorage, path: str, schema: pa.Schema | None = None,
               optional: tuple[str, ...] = ()) -> pa.Table:
    """The table at `path`; with `schema`, checked to have its columns (`check_columns`)."""
    table = pq.read_table(io.BytesIO(storage.read_bytes(path)))
    return table if schema is None else check_columns(table, schema, storage.url_of_path(path), optional)


def write_traces(storage: RunStorage, step: int, traces: list[Trace]) -> str:
    path = storage.step_path(step, "traces.parquet")
    write_table(storage, path, traces_to_table(traces))
    return path


def read_traces(storage: RunStorage, step: int) -> list[Trace]:
    path = storage.step_path(step, "traces.parquet")
    return table_to_traces(read_table(storage, path, TRACE_SCHEMA))


def write_samples(storage: RunStorage, path: str, samples: list[TrainingSample]) -> str:
    write_table(storage, path, samples_to_table(samples))
    return path


def read_samples(storage: RunStorage, path: str) -> list[TrainingSample]:
    return table_to_samples(read_table(storage, path, BATCH_SCHEMA, optional=OPTIONAL_BATCH_COLUMNS))


def write_batch(storage: RunStorage, step: int, samples: list[TrainingSample]) -> str:
    return write_samples(storage, storage.step_path(step, "batch.parquet"), samples)


def read_batch(storage: RunStorage, step: int) -> list[TrainingSample]:
    return read_samples(storage, storage.step_path(step, "batch.parquet"))


CHANNEL_SCHEMA = pa.schema(
    [
        ("algorithm_id", pa.string()),
        ("loss", pa.string()),
        ("trace_id", pa.string()),
        ("branch_index", pa.int32()),
        ("values", pa.list_(pa.float32())),
        ("mask", pa.list_(pa.bool_())),
    ]
)


def channels_to_table(channels: list[Channel]) -> pa.Table:
    """One row per channel (what one algorithm set on one branch)."""
    return pa.Table.from_pydict(
        {
            "algorithm_id": [c.algorithm_id for c in channels],
            "loss": [c.loss for c in channels],
            "trace_id": [c.trace_id for c in channels],
            "branch_index": [c.branch_index for c in channels],
            "values": [np.asarray(c.values, np.float32) for c in channels],
            "mask": [np.asarray(c.mask, np.bool_) for c in channels],
        },
        schema=CHANNEL_SCHEMA,
    )


def table_to_channels(table: pa.Table) -> list[Channel]:
    columns = {name: table.column(name) for name in CHANNEL_SCHEMA.names}
    return [
        Channel(
            algorithm_id=columns["algorithm_id"][row].as_py(),
            loss=columns["loss"][row].as_py(),
            trace_id=columns["trace_id"][row].as_py(),
            branch_index=columns["branch_index"][row].as_py(),
            values=_array(columns["values"], row, np.float32),
            mask=_array(columns["mask"], row, np.bool_),
        )
        for row in range(table.num_rows)
    ]


def write_channels(storage: RunStorage, path: str, channels: list[Channel]) -> str:
    write_table(storage, path, channels_to_table(channels))
    return path


def read_channels(storage: RunStorage, path: str) -> list[Channel]:
    return table_to_channels(read_table(storage, path, CHANNEL_SCHEMA))
