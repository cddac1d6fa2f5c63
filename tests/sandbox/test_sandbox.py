"""A sandbox's lifecycle: a cancelled program is killed with everything it started, and the folders of a process
that died without removing them (SIGKILL) go when the next sandbox starts."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from trace_rl.sandbox import Sandbox, SandboxConfig, bwrap_lack
from trace_rl.sandbox.sandbox import running

pytestmark = pytest.mark.skipif(bwrap_lack() is not None, reason=f"the sandbox needs {bwrap_lack()}")


def test_a_cancelled_program_is_killed_with_what_it_started(tmp_path):
    sandbox = Sandbox(SandboxConfig(), "cancelled", root=tmp_path)
    sandbox.start()
    started = []

    async def cancel():
        run = asyncio.ensure_future(sandbox.run(["sh", "-c", "sleep 600 & sleep 600"], {}))
        while not sandbox.processes:
            await asyncio.sleep(0.01)
        started.append(sandbox.processes[0].init_pid)
        await asyncio.sleep(0.3)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        await sandbox.close()

    asyncio.run(cancel())
    assert started[0] is not None and not running(started[0])
    assert sandbox.processes == [] and not sandbox.folder.exists()


def test_the_folders_of_a_killed_process_go_when_the_next_sandbox_starts(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f"{dead.stdout.strip()}-rollout" / "work"
    left.mkdir(parents=True)
    (left / "solution.py").write_text("print(1)")
    sandbox = Sandbox(SandboxConfig(), "next", root=tmp_path)
    sandbox.start()
    assert not left.parent.exists() and sandbox.folder.exists()
    asyncio.run(sandbox.close())
