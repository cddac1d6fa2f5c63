"""The reaper: what a process started dies with it when it is SIGKILLed, except what it detached on purpose."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trace_rl.machine.processes import command, descendants, is_alive, start_times, stat
from trace_rl.sandbox import bwrap_lack

ROOT = Path(__file__).resolve().parents[2]
SLEEP = "import time; time.sleep(600)"
# a parent with a reaper, a child that has a child of its own in a session of its own (as torchrun starts its
# ranks), a forked child (it holds the reaper's pipe open, as vLLM's engine does where it forks, on GPUs), and a
# process the parent started in its own session (as the embedded Prefect server is started); and a temp folder of
# the parent's (as its vLLM engine's)
PARENT = f"""
import multiprocessing, subprocess, sys, time
from trace_rl.machine import reaper, temp_folders
reaper.start()
folder = temp_folders.make("test")
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', {SLEEP!r}], start_new_session=True)"])
forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
forked.start()
detached = subprocess.Popen([sys.executable, "-c", {SLEEP!r}], start_new_session=True)
print(child.pid, detached.pid, folder, flush=True)
time.sleep(600)
"""


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_sigkilled_process_takes_what_it_started_along_but_not_what_it_detached_itself_and_leaves_no_folder():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child, detached, folder = parent.stdout.readline().split()
    child, detached, folder = int(child), int(detached), Path(folder)
    assert folder.is_dir() and folder.name.startswith(f"trace-rl-{parent.pid}-test-")
    assert wait_until(lambda: len(descendants(child)) == 1, 30), "the grandchild never started"
    started = start_times([*descendants(parent.pid), detached])
    reaper = [pid for pid in started if "trace_rl.machine.reaper" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(reaper) == 1 and len(started) == 5  # the reaper, the child and its child, the forked, the detached
    time.sleep(0.6)  # the reaper looks four times a second

    parent.kill()
    parent.wait()
    parent.stdout.close()
    try:
        gone = [pid for pid in started if pid != detached]
        assert wait_until(lambda: not any(is_alive(pid, started[pid]) for pid in gone), 5), [
            pid for pid in gone if is_alive(pid, started[pid])]
        assert is_alive(detached, started[detached])
        assert wait_until(lambda: not folder.exists(), 5)  # removed by the reaper
    finally:
        os.kill(detached, signal.SIGKILL)


# a sandbox's bwrap that has left the run's tree, as the pid 1 of a sandbox that was setting up when its run died:
# started by a process the parent detached (never recorded), which exits at once, and bound to nothing
ORPHAN = """
import subprocess, sys
from pathlib import Path
from trace_rl.sandbox import SandboxConfig
from trace_rl.sandbox.bwrap import bwrap_argv
work, tmp = Path(sys.argv[1]) / "work", Path(sys.argv[1]) / "tmp"
work.mkdir(parents=True)
tmp.mkdir()
argv = [arg for arg in bwrap_argv(["sleep", "600"], {}, SandboxConfig(), work, tmp, None) if arg != "--die-with-parent"]
subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""
SANDBOX_PARENT = f"""
import os, subprocess, sys, time
from trace_rl.machine import reaper
reaper.start()
for owner in (os.getpid(), int(sys.argv[2])):
    subprocess.run([sys.executable, "-c", {ORPHAN!r}, os.path.join(sys.argv[1], f"{{owner}}-orphan")],
                   start_new_session=True, check=True)
print("started", flush=True)
time.sleep(600)
"""


def sandboxes_in(folder: Path) -> dict[int, int]:
    """pid -> start time of the bwrap processes whose working folder is in `folder`, and of all below them."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and command(int(entry)).startswith("bwrap ") and f" {folder}/work " in command(int(entry)):
            for pid in [int(entry), *descendants(int(entry))]:
                if (status := stat(pid)) is not None:
                    found[pid] = status.start
    return found


@pytest.mark.skipif(bwrap_lack() is not None, reason=f"the sandbox needs {bwrap_lack()}")
def test_a_sigkilled_process_takes_its_sandboxes_along_wherever_they_are(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", SANDBOX_PARENT, str(tmp_path), str(os.getpid())], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline() == "started\n"
    ours, other = tmp_path / f"{parent.pid}-orphan", tmp_path / f"{os.getpid()}-orphan"
    # each: bwrap, the sandbox's pid 1, sleep
    assert wait_until(lambda: len(sandboxes_in(ours)) == 3 and len(sandboxes_in(other)) == 3, 30)
    orphans, others = sandboxes_in(ours), sandboxes_in(other)
    assert all(stat(pid).ppid != parent.pid and pid not in descendants(parent.pid) for pid in orphans)
    time.sleep(0.6)  # the reaper looks four times a second

    parent.kill()
    parent.wait()
    parent.stdout.close()
    try:
        assert wait_until(lambda: not any(is_alive(pid, start) for pid, start in orphans.items()), 5)
        assert all(is_alive(pid, start) for pid, start in others.items())  # another process's sandbox stays
    finally:
        for pid, start in others.items():
            if is_alive(pid, start):
                os.kill(pid, signal.SIGKILL)
