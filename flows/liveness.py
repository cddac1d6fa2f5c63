"""Flow runs whose process is gone: found, marked Crashed, and never mistaken for a live run.

A process killed by SIGKILL (or a machine that lost power) cannot report its end, so its `train`
flow run and the `train_step` subflow it was in stay Running in the UI. Every `train` flow run
therefore labels itself with the process running it (`trace-rl.host`, `.boot`, `.pid`, `.start`)
and its run directory (`trace-rl.run`). On this machine that tells a live run from a dead one at
once:

- `trace-rl train` refuses to start while a flow run of the same run directory is alive here
  (two processes would write one run);
- a `train` flow run, as it starts, marks the open flow runs of its run directory whose process is
  gone Crashed, with their subflows and task runs, naming itself as the run that took over;
- `trace-rl server start` marks every open trace-rl flow run of this machine whose process is gone.

For flow runs of other machines Prefect's own mechanism does it: `ensure_zombie_automation` keeps an
automation on the server that marks a `train`, `replay` or `eval` flow run Crashed once it sent no heartbeat for
9 minutes (flows heartbeat every 3 minutes, `PREFECT_FLOWS_HEARTBEAT_FREQUENCY`).

Subflows (`train_step`, `eval` inside `train`) run in their parent's process and send no heartbeat of
their own (`without_heartbeat`): the parent's speaks for that process, and Prefect joins a flow run's
heartbeat thread as the run ends, which waits out the thread's one-second sleep (0.9 s of a 1.1 s
empty subflow here). An open subflow whose parent has finished (the automation marked it Crashed) is
marked Crashed by the next `train` flow run or `trace-rl server start` (`crash_orphaned_subflows`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.runtime import flow_run as current_flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.states import Crashed
from prefect.utilities.urls import url_for

from trace_rl.errors import RefusedError
from trace_rl.machine.processes import identity, on_this_machine, still_running

# states a process holds a run in (a Scheduled one, e.g. awaiting a retry, has no process yet)
OPEN = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
FLOWS = ["train", "replay", "eval"]  # flows that send heartbeats (an `eval` inside `train` sends none)
SUBFLOWS = ["train_step", "eval"]
LABEL = "trace-rl."
ZOMBIE_AUTOMATION = "trace-rl: mark flow runs without heartbeats Crashed"
ZOMBIE_AFTER = timedelta(minutes=9)  # three missed heartbeats at Prefect's default of one per 180 s


@contextmanager
def without_heartbeat() -> Iterator[None]:
    """Flow runs started inside send no heartbeat: for subflows, whose parent's heartbeat covers their process."""
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def label_this_flow_run(run_url: str) -> None:
    """Label the current flow run with its run directory and the process running it."""
    labels = {f"{LABEL}run": run_url, **{f"{LABEL}{key}": value for key, value in identity().items()}}
    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(UUID(current_flow_run.get_id()), labels)


def process_of(run: FlowRun) -> dict[str, str]:
    """The process a flow run labelled itself with ({} for runs without the labels)."""
    return {key.removeprefix(LABEL): str(value) for key, value in (run.labels or {}).items() if key.startswith(LABEL)}


def open_runs(client, run_url: str | None = None) -> list[FlowRun]:
    """The open (not finished) `train` flow runs, of one run directory or of all."""
    runs = client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=OPEN))))
    return [run for run in runs if run_url is None or process_of(run).get("run") == run_url]


def refuse_if_running(run_url: str) -> None:
    """RefusedError when a flow run of this run directory is alive on this machine."""
    with get_client(sync_client=True) as client:
        for run in open_runs(client, run_url):
            process = process_of(run)
            if still_running(process):
                raise RefusedError(
                    f"run {run_url} is being trained right now by process {process['pid']} (flow run {run.name}: "
                    f"{url_for(run)}); wait for it to finish, or stop it (kill {process['pid']}) first")


def crash_gone_runs(run_url: str | None, why: str, keep: UUID | None = None) -> list[FlowRun]:
    """Mark the open `train` flow runs (of `run_url`, or all) whose process ran on this machine and is gone
    Crashed, with their subflows and task runs; the message says the process is gone and `why`."""
    crashed = []
    with get_client(sync_client=True) as client:
        for run in open_runs(client, run_url):
            process = process_of(run)
            if run.id == keep or not on_this_machine(process) or still_running(process) is not False:
                continue
            crash(client, run, f"the process that ran it (pid {process['pid']} on {process['host']}) is gone; {why}")
            crashed.append(run)
    return crashed


def crash_orphaned_subflows(why: str) -> list[FlowRun]:
    """Mark open `train_step` and `eval` subflows whose parent flow run has finished Crashed (their
    process is gone: the parent was marked Crashed by the heartbeat automation, on any machine)."""
    crashed = []
    with get_client(sync_client=True) as client:
        for run in client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=SUBFLOWS)),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=OPEN)))):
            if run.parent_task_run_id is None:  # a top-level `eval`: it sends its own heartbeats
                continue
            parent = client.read_flow_run(client.read_task_run(run.parent_task_run_id).flow_run_id)
            if parent.state is not None and parent.state.is_final():
                crash(client, run, f"its parent flow run {parent.name} ended {parent.state.name}; {why}")
                crashed.append(run)
    return crashed


def crash(client, run: FlowRun, message: str) -> None:
    """Mark a flow run, its open subflows (all the way down) and its open task runs Crashed."""
    runs = [run]
    while runs:
        current = runs.pop()
        client.set_flow_run_state(current.id, Crashed(message=message), force=True)
        for task in client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[current.id]),
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=OPEN), name=None))):
            client.set_task_run_state(task.id, Crashed(message=message), force=True)
        runs += client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[current.id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=OPEN))))


def ensure_zombie_automation() -> None:
    """Create, once per server, the automation that marks our flow runs Crashed after missed heartbeats
    (Prefect's zombie-flow detection, docs.prefect.io/v3/advanced/detect-zombie-flows)."""
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    with get_client(sync_client=True) as client:
        if client.read_automations_by_name(ZOMBIE_AUTOMATION):
            return
        client.create_automation(AutomationCore(
            name=ZOMBIE_AUTOMATION,
            description="trace-rl: a train, replay or eval flow run that sent no heartbeat for "
                        f"{ZOMBIE_AFTER.total_seconds():.0f} s has no process left; mark it Crashed",
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"},
                expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                        "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
                match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                match_related=ResourceSpecification({"prefect.resource.role": "flow",
                                                     "prefect.resource.name": FLOWS}),
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=ZOMBIE_AFTER,
            ),
            actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                        message="no heartbeat for 9 minutes: the process running it is gone")],
        ))
