"""Collect requests from many callers into batches for one worker thread.

Callers on any thread or event loop `submit` a request and get a `concurrent.futures.Future`. The worker
takes everything pending once arrivals pause for `settle_s` (at most `max_wait_s` after it woke), so the
requests a step issues together (every rollout's first turn, the next turns of rollouts whose turns
finished together) go out as one batch; requests that arrive while a batch runs form the next one.
The worker exits after `idle_exit_s` without requests (the next `submit` starts another), so an
unused batcher holds no thread and no reference to what it runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class RequestBatcher:
    def __init__(self, run_batch: Callable[[list[Any], list[Future]], None], *, settle_s: float = 0.005,
                 max_wait_s: float = 0.05, idle_exit_s: float = 5.0, name: str = "request-batcher"):
        self._run_batch = run_batch
        self._settle_s = settle_s
        self._max_wait_s = max_wait_s
        self._idle_exit_s = idle_exit_s
        self._name = name
        self._pending: list[tuple[Any, Future]] = []
        self._arrived = threading.Condition()
        self._worker: threading.Thread | None = None

    def submit(self, request: Any) -> Future:
        future: Future = Future()
        with self._arrived:
            self._pending.append((request, future))
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
            deadline = time.monotonic() + self._max_wait_s
            while (left := deadline - time.monotonic()) > 0:
                count = len(self._pending)
                self._arrived.wait(min(self._settle_s, left))
                if len(self._pending) == count:
                    break
            batch, self._pending = self._pending, []
        return [(request, future) for request, future in batch if future.set_running_or_notify_cancel()]

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
