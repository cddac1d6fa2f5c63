"""The processes a trace-rl process starts die with it, however it ends (SIGKILL included).

`start()` is called where such processes are started: the vLLM engine (`trace_rl.inference.vllm_engine`), the
torchrun trainer workers (`trace_rl.trainer.launcher`, `trace_rl.trainer.nodes`), a sandbox (`trace_rl.sandbox`),
and the `trace-rl` commands. So every process that starts them has its own reaper, whoever started that process:
the CLI, a Prefect worker's or `trace-rl serve`'s flow run subprocess, an env server, a benchmark side, a library
user's script calling the flows.

A process that dies by SIGKILL runs no cleanup, so its vLLM engine (EngineCore and its model
worker, ~2.4 GB on CPU) would stay alive with nobody to talk to. `start()` therefore launches a
small watcher, `python -m trace_rl.machine.reaper <pid>`, with a pipe from this process on its stdin.
Four times a second the watcher records the processes below this one; when the pipe reaches EOF
(this process is gone, however it ended) or its parent changes (a child forked from this process
may hold the pipe open), it SIGKILLs every recorded process that still runs, with whatever those
started since, and exits. After a normal exit there is usually nothing left to kill (the CLI
stops its vLLM engines first); whatever still runs is killed as after a crash.

Two kinds of process are not recorded:
- a process that the watched process itself started in a session of its own, with everything below it: the
  embedded Prefect server is started so (`start_new_session=True`) because it outlives the run and serves the
  next ones. Deeper down a new session means nothing of the kind: torchrun starts every trainer rank in a
  session of its own, and a rank must die with the run;
- multiprocessing's resource tracker: it exits by itself once the processes it tracks are gone,
  after unlinking the shared memory they leaked (killing it would leave that in /dev/shm).

A sandbox's bwrap (trace_rl/sandbox) makes a session of its own itself (`--new-session`), so it is recorded
all the same. Its `--die-with-parent` leaves a window: bwrap's pid 1 in the sandbox binds itself to the outer
bwrap only once it has set the sandbox up, so a sandbox that was setting up when the run died outlives it,
with no parent of the run's (the suite saw such sandboxes, their daemons running). The reaper therefore also
kills, wherever they are, the bwrap processes whose working folder says they belong to the run's processes.

The parent's temp folders (`trace_rl.machine.temp_folders`: an engine's sockets and log, the trainer workers'
private config) are removed after the kill: a process killed outright removes nothing itself.

Standard library only, so the watcher starts in well under a second.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading

from trace_rl.machine import temp_folders
from trace_rl.machine.processes import argv, children, command, descendants, is_alive, name, stat

POLL_S = 0.25
RESOURCE_TRACKER = "multiprocessing.resource_tracker"
SANDBOX = "bwrap "  # a sandbox's command line starts so (trace_rl.sandbox.bwrap)

_reaper: subprocess.Popen | None = None
_owner = 0  # the pid that started `_reaper`: a process forked from it needs a reaper of its own
_lock = threading.Lock()


def start() -> None:
    """Start this process's reaper (once per process; later calls do nothing)."""
    global _reaper, _owner
    with _lock:
        if _reaper is None or _owner != os.getpid() or _reaper.poll() is not None:
            _reaper = subprocess.Popen([sys.executable, "-m", "trace_rl.machine.reaper", str(os.getpid())],
                                       stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            _owner = os.getpid()


# -- the watcher, in its own process ---------------------------------------------------------
def watched(parent: int, session: int, recorded: dict[int, int]) -> None:
    """Add the processes below `parent` (but not what it detached, the resource tracker or this one) to `recorded`
    (pid -> start time)."""
    queue = [parent]
    while queue:
        above = queue.pop()
        for child in children(above):
            found = stat(child)
            if found is None or child == os.getpid():
                continue
            if above == parent and found.sid != session and not command(child).startswith(SANDBOX):
                continue  # detached by the watched process (with everything below it)
            if RESOURCE_TRACKER not in command(child):
                recorded[child] = found.start
            queue.append(child)


def folder_owner(folder: str) -> int | None:
    """The pid that a sandbox's folder, `<root>/<pid>-<name>` (trace_rl.sandbox.sandbox), names; None for another."""
    owner = os.path.basename(folder).partition("-")[0]
    return int(owner) if owner.isdigit() else None


def sandbox_owner(pid: int) -> int | None:
    """The pid of the process whose sandbox the bwrap process `pid` runs, read from the working folder its command
    line names, `--chdir <root>/<owner pid>-<name>/work`; None for another process."""
    args = argv(pid)
    if not args or args[0] != "bwrap" or "--chdir" not in args[:-1]:
        return None
    return folder_owner(os.path.dirname(args[args.index("--chdir") + 1]))


def sandboxes(owners: set[int]) -> set[int]:
    """The bwrap processes of the sandboxes of `owners`, wherever they are now."""
    return {int(entry) for entry in os.listdir("/proc") if entry.isdigit() and sandbox_owner(int(entry)) in owners}


def kill(parent: int, recorded: dict[int, int]) -> list[str]:
    """SIGKILL the recorded processes that still run, the sandboxes of `parent` and of those processes, and
    everything below them; returns what was killed."""
    alive = {pid for pid, start in recorded.items() if is_alive(pid, start)}
    targets = alive | sandboxes({parent, *alive})  # the pid of a recorded process that has ended may name another
    for pid in list(targets):  # what they started since the last look
        targets |= {child for child in descendants(pid) if RESOURCE_TRACKER not in command(child)}
    killed = []
    for pid in sorted(targets):
        label = f"{name(pid)} (pid {pid})"
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(label)
        except ProcessLookupError:
            pass
    return killed


def watch(parent: int) -> None:
    """Record `parent`'s processes until it is gone, then kill what of them still runs and remove its temp
    folders."""
    session = os.getsid(0)
    recorded: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready and not os.read(0, 64):  # EOF: the parent is gone (it never writes)
            break
        if os.getppid() != parent:
            break
        watched(parent, session, recorded)
    killed = kill(parent, recorded)
    for folder in temp_folders.left_by(parent):
        temp_folders.remove(folder)
    if killed:
        print(f"trace-rl: the process {parent} is gone; killed the processes it started: {', '.join(killed)}",
              file=sys.stderr, flush=True)


def main() -> None:
    # Ctrl-C and a closed terminal signal the whole process group: the reaper outlives them to clean up
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    watch(int(sys.argv[1]))


if __name__ == "__main__":
    main()
