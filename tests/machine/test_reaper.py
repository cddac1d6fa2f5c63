"""The reaper: what a process started dies with it when it is SIGKILLed, except what it detached on purpose."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trace_rl.machine.processes import descendants, is_alive, stat

ROOT = Path(__file__).resolve().parents[2]
SLEEP = "import time; time.sleep(600)"
# a parent with a reaper, a child that has a child of its own in a session of its own (as torchrun starts its
# ranks), a forked child (it holds the reaper's pipe open, as vLLM's engine does where it forks, on GPUs), and a
# process the parent started in its own session (as the embedded Prefect server is started)
PARENT = f"""
import multiprocessing, subprocess, sys, time
from trace_rl.machine import reaper
reaper.start()
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', {SLEEP!r}], start_new_session=True)"])
forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
forked.start()
detached = subprocess.Popen([sys.executable, "-c", {SLEEP!r}], start_new_session=True)
print(child.pid, detached.pid, flush=True)
time.sleep(600)
"""


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_sigkilled_process_takes_what_it_started_along_but_not_what_it_detached_itself():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child, detached = map(int, parent.stdout.readline().split())
    assert wait_until(lambda: len(descendants(child)) == 1, 30), "the grandchild never started"
    started = {pid: stat(pid).start for pid in [*descendants(parent.pid), detached]}
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
    finally:
        os.kill(detached, signal.SIGKILL)
