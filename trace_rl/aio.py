"""The asyncio helpers several rooms share: structured concurrency that reports the failure itself rather than an
ExceptionGroup, and running a coroutine from synchronous code (every pipeline stage is synchronous)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Coroutine, Iterable
from typing import Any


async def gather_or_cancel(coroutines: Iterable[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run the coroutines concurrently and return their results in order; on the first
    failure cancel the others and raise that exception (so callers catch e.g. AlgorithmError)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coroutine) for coroutine in coroutines]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


def run_sync(coroutine):
    """Run a coroutine to completion from sync code, also where this thread already runs an event loop
    (e.g. a flow executed by `prefect flow-run retry`): then on a fresh thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
