"""`dataset`: single-turn prompts and reference answers from your own data (docs/envs.md).

Rows come from a JSONL, Parquet or CSV file at any fsspec URL, or a Hugging Face `datasets` directory
(`save_to_disk` output, read with `load_from_disk`; any other local directory with `load_dataset`),
all offline. `path` is one source, or a table of sources by split (`{train = "...", eval = "..."}`);
`split` picks one (a `datasets` directory holding several splits picks the split itself).

A row gives the prompt (`prompt_column`), or the whole chat (`messages_column`, a list of
{role, content}), and the reference answer (`answer_column`); the reward compares the completion with
the answer (`trace_rl.envs.rewards`). Steps walk the rows in order, `batch_size` a step, reshuffled
each epoch by the run seed (`shuffle`); past `epochs` passes the step fails. Every row is checked when
the config loads: a missing column, an empty prompt or an unreadable file is an error naming the
file, the row (from 1) and the column; nothing is skipped.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trace_rl.data.trace import Message, Trace
from trace_rl.envs.base import EnvError, Environment, Example, Sampler, derive_seed, epoch_stream
from trace_rl.envs.registry import register_env
from trace_rl.envs.rewards import load_reward

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}


class DatasetOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | dict[str, str] = Field(..., description="a file or directory URL, or {split = URL, ...}")
    split: str = Field("train", description="which split (usually 'train', or 'eval' under [[eval.envs]])")
    format: Literal["auto", "jsonl", "parquet", "csv", "datasets"] = Field(
        "auto", description="auto: by the file suffix; a directory is a `datasets` one")
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    messages_column: str | None = Field(None, description="chat rows: this column's messages are the prompt")
    system_prompt: str | None = None
    reward: str = Field("exact", description="exact, numeric, math or 'package.module:function'")
    shuffle: bool = Field(True, description="a new order every epoch, seeded by the run seed")
    epochs: int | None = Field(None, ge=1, description="passes over the rows before the run fails (None: no limit)")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for the URL")

    @property
    def source(self) -> str:
        if isinstance(self.path, str):
            return self.path
        if self.split not in self.path:
            raise EnvError(f"args.split {self.split!r} is not in args.path (splits: {', '.join(self.path)})")
        return self.path[self.split]


def read_source(url: str, format: str, split: str, storage_options: dict[str, Any]) -> list[dict]:
    """The raw rows of one file or `datasets` directory; EnvError naming the file when it cannot be read."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        if not fs.exists(path):
            raise EnvError(f"{url}: no such file or directory")
        if format == "datasets" or (format == "auto" and fs.isdir(path)):
            return read_datasets_dir(url, split)
        kind = format if format != "auto" else FORMATS.get("." + path.rsplit(".", 1)[-1].lower())
        if kind is None:
            raise EnvError(f"{url}: unknown file type; name it .jsonl, .parquet or .csv, or set args.format")
        with fs.open(path, "rb") as f:
            data = f.read()
    except EnvError:
        raise
    except Exception as exc:  # noqa: BLE001  (any failure to open it is the file's problem)
        raise EnvError(f"{url}: cannot read it ({type(exc).__name__}: {exc})") from None
    if kind == "jsonl":
        return read_jsonl(url, data)
    if kind == "csv":
        try:
            return list(csv.DictReader(io.StringIO(data.decode("utf-8"))))
        except (UnicodeDecodeError, csv.Error) as exc:
            raise EnvError(f"{url}: not a readable CSV file ({exc})") from None
    import pyarrow.parquet as pq

    try:
        return pq.read_table(io.BytesIO(data)).to_pylist()
    except Exception as exc:  # noqa: BLE001
        raise EnvError(f"{url}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None


def read_jsonl(url: str, data: bytes) -> list[dict]:
    rows = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EnvError(f"{url}: line {number} is not valid JSON ({exc.msg}); fix or remove it") from None
        if not isinstance(row, dict):
            raise EnvError(f"{url}: line {number} is not a JSON object; each line must be one row {{...}}")
        rows.append(row)
    return rows


def read_datasets_dir(url: str, split: str) -> list[dict]:
    """A local `datasets` directory: `save_to_disk` output (a dataset, or one split of a DatasetDict) via
    `load_from_disk`, any other via `load_dataset` (data files in a folder), offline either way."""
    import datasets

    try:
        loaded = datasets.load_from_disk(url)
    except FileNotFoundError:
        try:
            loaded = datasets.load_dataset(url)
        except Exception as exc:  # noqa: BLE001
            raise EnvError(f"{url}: not a readable datasets directory ({type(exc).__name__}: {exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise EnvError(f"{url}: has no split {split!r} (splits: {', '.join(loaded)}); set args.split")
        loaded = loaded[split]
    return loaded.to_list()


def check_rows(url: str, rows: list[dict], args: DatasetOptions) -> list[tuple[list[Message], str]]:
    """(prompt messages, answer) of every row; EnvError naming the file, row (from 1) and column of a bad one."""
    if not rows:
        raise EnvError(f"{url}: has no rows")
    out = []
    for number, row in enumerate(rows, start=1):
        where = f"{url}: row {number}"
        columns = ", ".join(map(str, row))
        for column in (args.messages_column or args.prompt_column, args.answer_column):
            if column not in row:
                raise EnvError(f"{where}: no column {column!r} (columns: {columns}); fix the row or map the column "
                               "with args.prompt_column / messages_column / answer_column")
        if row[args.answer_column] is None:
            raise EnvError(f"{where}: column {args.answer_column!r} is empty; every row needs an answer")
        if args.messages_column:
            messages = parse_messages(f"{where}: column {args.messages_column!r}", row[args.messages_column])
        else:
            prompt = row[args.prompt_column]
            if not isinstance(prompt, str) or not prompt.strip():
                raise EnvError(f"{where}: column {args.prompt_column!r} is an empty prompt; fill it or remove the row")
            messages = [Message(role="user", content=prompt)]
        if args.system_prompt and messages[0].role != "system":
            messages.insert(0, Message(role="system", content=args.system_prompt))
        out.append((messages, str(row[args.answer_column]).strip()))
    return out


def parse_messages(where: str, value: Any) -> list[Message]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise EnvError(f"{where}: not a list of messages (nor JSON of one)") from None
    if not isinstance(value, list) or not value:
        raise EnvError(f"{where}: must be a non-empty list of {{role, content}} messages")
    try:
        messages = [Message(role=m["role"], content=m["content"]) for m in value]
    except (KeyError, TypeError):
        raise EnvError(f"{where}: every message needs a role and a content") from None
    if messages[-1].role != "user" or not messages[-1].content.strip():
        raise EnvError(f"{where}: the last message must be a non-empty user message (the model answers it)")
    return messages


@functools.lru_cache(maxsize=16)
def _load(args_json: str) -> tuple[tuple[list[Message], str], ...]:
    args = DatasetOptions.model_validate_json(args_json)
    url = args.source
    return tuple(check_rows(url, read_source(url, args.format, args.split, args.storage_options), args))


def load_rows(args: DatasetOptions) -> tuple[tuple[list[Message], str], ...]:
    """The checked rows of the configured split, read once per process."""
    return _load(args.model_dump_json())


@register_env("dataset")
class Dataset(Environment):
    Options = DatasetOptions

    def __init__(self, args=None):
        super().__init__(args)
        self.rows = load_rows(self.args)
        self.reward = load_reward(self.args.reward)

    @classmethod
    def check_config(cls, options: DatasetOptions) -> list[str]:
        try:
            load_rows(options)
            load_reward(options.reward)
        except EnvError as exc:
            return [str(exc)]
        return []

    def order(self, run_seed: int, env_index: int, epoch: int) -> list[int]:
        """Row indices of one epoch: a permutation seeded by (run seed, env index, epoch), or the file order."""
        order = list(range(len(self.rows)))
        if self.args.shuffle:
            random.Random(derive_seed(run_seed, env_index, epoch)).shuffle(order)
        return order

    def examples_for_step(self, run_seed: int, step: int, env_index: int, count: int) -> list[Example]:
        """Rows (step - 1) * count ... step * count - 1 of the epoch-after-epoch stream of rows."""
        stream = epoch_stream(step, count, len(self.rows), lambda epoch: self.order(run_seed, env_index, epoch))
        if stream and self.args.epochs is not None and stream[-1][0] >= self.args.epochs:
            raise EnvError(
                f"dataset {self.args.source}: {self.args.epochs} epoch(s) of {len(self.rows)} rows are used up at "
                f"step {step} ({count} examples a step); raise args.epochs or lower `steps`")
        return [Example(id=f"{self.args.split}-{row + 1}-e{epoch}", data={"row": row}) for epoch, row in stream]

    def examples(self, seed: int, count: int) -> list[Example]:
        return self.examples_for_step(seed, 1, 0, count)

    def refill_examples(self, run_seed: int, step: int, env_index: int, round_: int, count: int) -> list[Example]:
        """Up to `count` distinct rows drawn at random, seeded by (run seed, step, env index, "refill", round), apart
        from the epoch stream (a refill does not advance it, nor count against `epochs`)."""
        rng = random.Random(derive_seed(run_seed, step, env_index, "refill", round_))
        rows = rng.sample(range(len(self.rows)), min(count, len(self.rows)))
        return [Example(id=f"{self.args.split}-{row + 1}", data={"row": row}) for row in rows]

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        messages, answer = self.rows[example.data["row"]]
        conversation = sampler.conversation(messages)
        completion = await conversation.sample()
        reward = float(self.reward(completion, answer))
        return [self.trace(
            example, conversation, reward=reward, rewards={self.args.reward: reward},
            metrics={"truncated": float(conversation.last_finish_reason == "length")}, info={"answer": answer},
        )]
