"""Structured concurrency that reports the failure itself rather than an ExceptionGroup."""

from __future__ import annotations

import asyncio
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
