"""Resumable stages: Prefect's persisted results with a cache key per (run, step, stage, config).

The key does not involve the flow run id, so Retry in the UI, `prefect flow-run retry` and
`trace-rl train --resume` in a new process all find the stages a crashed step finished.
Results and cache records live in the run's own storage under `prefect/`, so they go
wherever the run goes (and `--overwrite` wipes them with it).
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.filesystems import LocalFileSystem, RemoteFileSystem

from trace_rl import credentials
from trace_rl.config import Config, config_hash
from trace_rl.storage import RunStorage, step_name


class StageCache(CachePolicy):
    """Cache key `<run>/<step>/<stage>[/<algorithm job>]/<config hash>`."""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str:
        config: Config = inputs["config"]
        job = inputs.get("job")
        parts = [config.name, step_name(inputs["step"]), task_ctx.task.name, job.key if job else "", config_hash(config)]
        return "-".join(p for p in parts if p)


def run_filesystem(storage: RunStorage, folder: str):
    url = storage.url_of("prefect", folder)
    if storage.protocol in ("file", "local"):
        return LocalFileSystem(basepath=url)
    return RemoteFileSystem(basepath=url, settings=credentials.resolve(storage.storage_options))


_SAVED_BLOCKS: dict[str, Any] = {}


def saved_result_storage(storage: RunStorage):
    """The run's result storage, saved on the Prefect server once per process (Prefect requires a saved block).

    The saved instance itself is handed to tasks: a slug would make every task run load the
    block document from the server, twice, which cost more than the rest of the task.
    """
    block = run_filesystem(storage, "results")
    name = "trace-rl-" + hashlib.sha256(block.basepath.encode()).hexdigest()[:16]
    if name not in _SAVED_BLOCKS:
        if isinstance(block, RemoteFileSystem):
            # the block document on the server holds no credentials (references such as env:NAME stay as
            # written); this process's instance gets the real ones back once it is saved
            real = block.settings
            block.settings = credentials.public(storage.storage_options)
            block.save(name, overwrite=True)
            block.settings = real
        else:
            block.save(name, overwrite=True)
        _SAVED_BLOCKS[name] = block
    return _SAVED_BLOCKS[name]


def stage_options(storage: RunStorage) -> dict[str, Any]:
    """`Task.with_options` keyword arguments that make a stage resumable for the run in `storage`."""
    return {
        "cache_policy": StageCache().configure(key_storage=run_filesystem(storage, "cache")),
        "result_storage": saved_result_storage(storage),
        "result_serializer": "json",
        "persist_result": True,
    }
