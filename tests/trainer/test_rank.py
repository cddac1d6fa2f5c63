"""A torchrun rank ends as soon as its launcher is gone, also while it is blocked where it never looks (the process
group's rendezvous, a collective whose peer died)."""

from __future__ import annotations

import subprocess
import sys
import time

from trace_rl.machine import processes

BLOCKED_RANK = """
import sys, time
from trace_rl.trainer.rank import exit_without_launcher
exit_without_launcher(int(sys.argv[1]), int(sys.argv[2]), 0.05)
print("blocked", flush=True)
time.sleep(600)  # stands for a rendezvous that never completes
"""


def test_a_rank_blocked_anywhere_exits_once_its_launcher_is_gone():
    launcher = subprocess.Popen(["sleep", "600"])
    rank = subprocess.Popen([sys.executable, "-c", BLOCKED_RANK, str(launcher.pid),
                             str(processes.stat(launcher.pid).start)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "blocked"
        time.sleep(0.3)
        assert rank.poll() is None  # it waits while its launcher lives
        launcher.kill()
        launcher.wait()
        assert rank.wait(timeout=10) == 0
    finally:
        for process in (launcher, rank):
            process.kill()
