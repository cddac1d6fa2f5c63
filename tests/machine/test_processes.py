import subprocess
import sys

from trace_rl.machine.processes import start_times, stat


def test_start_times_keep_the_running_pids_with_their_start_times_and_leave_out_those_that_ended():
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # reaped: its pid names no process any more
    try:
        assert start_times([running.pid, ended.pid]) == {running.pid: stat(running.pid).start}
    finally:
        running.kill()
        running.wait()
