"""Processes on this machine, read from /proc (Linux): who started whom, and whether a pid still names
the process it named before (a pid is reused once its process is gone; the pair pid + start time is not).

Standard library only: the reaper (`trace_rl.machine.reaper`) runs this in a small process of its own.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import NamedTuple

# /proc/<pid>/task/<tid>/children lists a thread's children; kernels built without CONFIG_PROC_CHILDREN lack
# it, and `children` then reads the parent of every process instead
CHILDREN_FILES = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


class Stat(NamedTuple):
    ppid: int
    sid: int  # the session id: a process started with `start_new_session=True` (setsid) has its own
    start: int  # the start time, in clock ticks after boot
    state: str  # "Z" is a zombie: it has exited and only waits for its parent to collect its exit code


def stat(pid: int) -> Stat | None:
    """The process's parent, session, start time and state; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text.rsplit(b")", 1)[1].split()  # the command name before it may hold spaces and parentheses
    return Stat(ppid=int(fields[1]), sid=int(fields[3]), start=int(fields[19]), state=fields[0].decode())


def is_alive(pid: int, start: int) -> bool:
    """True while the process `pid` that started at `start` runs (a zombie has exited: not alive)."""
    found = stat(pid)
    return found is not None and found.start == start and found.state != "Z"


def start_times(pids: list[int]) -> dict[int, int]:
    """The start time of each of `pids` that still runs: pid -> start (a process that ended meanwhile is left out)."""
    return {pid: found.start for pid in pids if (found := stat(pid)) is not None}


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    if not CHILDREN_FILES:
        return [int(n) for n in os.listdir("/proc") if n.isdigit() and (s := stat(int(n))) and s.ppid == pid]
    found: list[int] = []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as handle:
                found += [int(child) for child in handle.read().split()]
        except OSError:  # the thread exited meanwhile
            pass
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, and so on."""
    found: list[int] = []
    queue = children(pid)
    while queue:
        child = queue.pop()
        found.append(child)
        queue += children(child)
    return found


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def identity(pid: int | None = None) -> dict[str, str]:
    """What names a process across machines and reboots: host, boot id, pid and start time."""
    pid = pid or os.getpid()
    found = stat(pid)
    return {"host": socket.gethostname(), "boot": boot_id(), "pid": str(pid),
            "start": str(found.start if found else "")}


def on_this_machine(process: dict[str, str]) -> bool:
    """True when `process` (an `identity()`) was taken on this machine since its last boot."""
    return process.get("host") == socket.gethostname() and process.get("boot") == boot_id()


def still_running(process: dict[str, str]) -> bool | None:
    """Whether the process of an `identity()` still runs: None when it ran on another machine (unknown)."""
    if not on_this_machine(process):
        return None
    try:
        return is_alive(int(process["pid"]), int(process["start"]))
    except (KeyError, ValueError):
        return None


def argv(pid: int) -> list[str]:
    """The process's arguments, its program first ([] when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            args = handle.read().decode(errors="replace").split("\0")
    except OSError:
        return []
    return args[:-1] if args[-1] == "" else args  # a process that rewrote its title may end it without a NUL


def command(pid: int) -> str:
    """The process's command line ('' when it is gone)."""
    return " ".join(argv(pid)).strip()


def memory(pid: int) -> int:
    """The process's proportional set size in bytes (its own pages plus its share of those it maps with others, so
    a sum over processes counts a shared page once); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def machine_memory() -> int:
    """This machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def name(pid: int) -> str:
    """The process's name as `ps` shows it (vLLM names its processes, e.g. VLLM::EngineCore)."""
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "?"
