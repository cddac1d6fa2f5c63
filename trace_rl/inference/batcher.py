"""Collect requests from many callers into batches for one worker thread.

Callers on any thread or event loop `submit` a request and get a `concurrent.futures.Future`. A batch is
everything pending once its callers can submit nothing more: for callers on an event loop, once that loop has
run every callback that was ready (its coroutines all wait: on the model, on a timer, on I/O), so the requests a
step issues together (every rollout's first turn, the next turns of rollouts whose turns finished together) go
out as one batch, the same one whatever the machine's load. A different batch rounds differently (CPU GEMM results
depend on the row count), so same seed and step give the same traces only because of that. Callers on plain
threads are taken once their arrivals pause for `settle_s` (at most `max_wait_s` after the worker woke).
Requests that arrive while a batch runs form the next one. The worker exits after `idle_exit_s` without
requests (the next `submit` starts another), so an unused batcher holds no thread and no reference to what it runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# a loop that has callbacks ready this many times in a row is taken as idle (a coroutine polling with
# `await asyncio.sleep(0)` never lets it be)
MAX_BUSY_PASSES = 1000


class RequestBatcher:
    def __init__(self, run_batch: Callable[[list[Any], list[Future]], None], *, settle_s: float = 0.005,
                 max_wait_s: float = 0.05, idle_exit_s: float = 5.0, name: str = "request-batcher"):
        self._run_batch = run_batch
        self._settle_s = settle_s
        self._max_wait_s = max_wait_s
        self._idle_exit_s = idle_exit_s
        self._name = name
        self._pending: list[tuple[Any, Future, asyncio.AbstractEventLoop | None]] = []
        self._arrived = threading.Condition()
        self._worker: threading.Thread | None = None

    def submit(self, request: Any) -> Future:
        future: Future = Future()
        with self._arrived:
            self._pending.append((request, future, running_loop()))
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._worker.start()
            self._arrived.notify()
        return future

    def _take_batch(self) -> list[tuple[Any, Future]] | None:
        """The next batch; None when none came for `idle_exit_s` (the worker then ends)."""
        with self._arrived:
            if not self._pending and not self._arrived.wait_for(lambda: self._pending, self._idle_exit_s):
                self._worker = None
                return None
            loops = {loop for _, _, loop in self._pending if loop is not None}
            from_threads = any(loop is None for _, _, loop in self._pending)
        for loop in loops:
            wait_until_idle(loop)
        with self._arrived:
            if from_threads:
                deadline = time.monotonic() + self._max_wait_s
                while (left := deadline - time.monotonic()) > 0:
                    count = len(self._pending)
                    self._arrived.wait(min(self._settle_s, left))
                    if len(self._pending) == count:
                        break
            batch, self._pending = self._pending, []
        return [(request, future) for request, future, _ in batch if future.set_running_or_notify_cancel()]

    def _serve(self) -> None:
        while (batch := self._take_batch()) is not None:
            if not batch:
                continue
            requests, futures = [r for r, _ in batch], [f for _, f in batch]
            try:
                self._run_batch(requests, futures)
            except BaseException as exc:  # noqa: BLE001 - every caller of the batch must hear of it
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)


_idle_waiters: dict[asyncio.AbstractEventLoop, list[threading.Event]] = {}
_idle_lock = threading.Lock()


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread; None on a plain thread."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def wait_until_idle(loop: asyncio.AbstractEventLoop) -> None:
    """Block this (other) thread until `loop` has no callback ready to run, or stops.

    One probe per loop serves every thread waiting on it: two probes would each see the other ready, for good.
    The probe reads the loop's ready queue (`_ready`, asyncio's own event loops; a loop without one counts as
    idle after one pass through its ready callbacks).
    """
    if not loop.is_running():
        return
    idle = threading.Event()
    with _idle_lock:
        waiters = _idle_waiters.setdefault(loop, [])
        waiters.append(idle)
        first = len(waiters) == 1
    if first:
        try:
            loop.call_soon_threadsafe(_probe, loop, 0)
        except RuntimeError:  # the loop is closed
            _wake(loop)
    while not idle.wait(0.1):
        if not loop.is_running():  # stopped: nothing on it will submit until it runs again
            _wake(loop)


def _probe(loop: asyncio.AbstractEventLoop, passes: int) -> None:
    if getattr(loop, "_ready", None) and passes < MAX_BUSY_PASSES:
        loop.call_soon(_probe, loop, passes + 1)  # behind the callbacks ready now, and what they schedule
    else:
        _wake(loop)


def _wake(loop: asyncio.AbstractEventLoop) -> None:
    with _idle_lock:
        for event in _idle_waiters.pop(loop, []):
            event.set()
