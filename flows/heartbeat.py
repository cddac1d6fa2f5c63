"""Flow-run heartbeats that cost nothing when a step ends.

Prefect detects crashed flow runs by their missing heartbeats. Its own heartbeat thread sleeps
in one-second ticks and is joined when the flow run ends, which costs up to a second per
`train_step` subflow. The long-running `train` flow keeps Prefect's heartbeat; for its step
subflows it switches Prefect's off (`child_heartbeats_from_here`) and each step emits the same
`prefect.flow-run.heartbeat` events from a thread that stops the moment the step does
(`heartbeats`), so crash detection covers long steps at the same interval.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from prefect.events import emit_event
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

_INTERVAL_S: ContextVar[int | None] = ContextVar("trace_rl_step_heartbeat_s", default=None)


@contextmanager
def child_heartbeats_from_here() -> Iterator[None]:
    """Inside a parent flow: child flow runs emit their own heartbeats (see `heartbeats`)."""
    token = _INTERVAL_S.set(get_current_settings().flows.heartbeat_frequency)
    try:
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield
    finally:
        _INTERVAL_S.reset(token)


@contextmanager
def heartbeats() -> Iterator[None]:
    """Inside a flow run whose parent turned Prefect's heartbeats off: emit them, stop instantly at exit."""
    interval = _INTERVAL_S.get()
    if interval is None:  # not under child_heartbeats_from_here: Prefect's own thread covers this run
        yield
        return
    resource = {"prefect.resource.id": f"prefect.flow-run.{flow_run.get_id()}",
                "prefect.resource.name": flow_run.get_name() or ""}
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            emit_event(event="prefect.flow-run.heartbeat", resource=resource)
            stop.wait(interval)

    thread = threading.Thread(target=beat, name="trace-rl-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
