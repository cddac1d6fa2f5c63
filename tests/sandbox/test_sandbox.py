"""A sandbox's lifecycle: a cancelled program is killed with everything it started, and the folders of a process
that died without removing them (SIGKILL) go when the next sandbox starts."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_a_program_that_cannot_start_or_whose_sandbox_is_killed_ends_at_once_with_the_reason(tmp_path):
    """A missing program is exit 127 with prlimit's reason; a sandbox killed from outside mid-program (its bwrap, or
    the init of its pid namespace: an operator, the OOM killer) ends its run at once, its daemon too."""
    import os
    import signal
    import time

    sandbox = Sandbox(SandboxConfig(), "dies", root=tmp_path)
    sandbox.start()

    async def killed(pick) -> tuple:
        run = asyncio.ensure_future(sandbox.run(["sh", "-c", "sleep 600 & sleep 600"], {}))
        while not sandbox.processes:
            await asyncio.sleep(0.01)
        process = sandbox.processes[0]
        await asyncio.sleep(0.3)
        os.kill(pick(process), signal.SIGKILL)
        begun = time.monotonic()
        outcome = await asyncio.wait_for(run, 10)
        return outcome, time.monotonic() - begun, process.init_pid

    async def play():
        missing = await sandbox.run(["no-such-program"], {})
        outer = await killed(lambda process: process.pid)
        init = await killed(lambda process: process.init_pid)
        await sandbox.close()
        return missing, outer, init

    missing, (outer, outer_s, outer_init), (init, init_s, _) = asyncio.run(play())
    assert missing.exit_code == 127
    assert b"failed to execute no-such-program: No such file or directory" in missing.stderr
    assert outer.exit_code == -9 and outer.stderr.endswith(b"sandbox: the sandbox was killed from outside (signal 9)\n")
    assert init.exit_code == 137 and init.limit is None  # bwrap reports its init's death as a shell does
    assert outer_s < 2 and init_s < 2 and not running(outer_init)


def test_the_folders_of_a_killed_process_go_when_the_next_sandbox_starts(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f"{dead.stdout.strip()}-rollout" / "work"
    left.mkdir(parents=True)
    (left / "solution.py").write_text("print(1)")
    sandbox = Sandbox(SandboxConfig(), "next", root=tmp_path)
    sandbox.start()
    assert not left.parent.exists() and sandbox.folder.exists()
    asyncio.run(sandbox.close())


def test_a_sigkilled_run_leaves_no_process_of_its_sandbox(tmp_path):
    """The trainer dies by SIGKILL with a program running: bwrap dies with its parent, and its pid namespace
    with it; the folders go at the next start. The sandbox started the trainer's reaper, for a sandbox that bwrap
    has not yet bound to it (tests/machine/test_reaper.py)."""
    import os
    import signal
    import time

    from trace_rl.machine.processes import command, descendants

    program = f"""
import asyncio, sys
from pathlib import Path
from trace_rl.sandbox import Sandbox, SandboxConfig
async def main():
    sandbox = Sandbox(SandboxConfig(), "killed", root=Path({str(tmp_path)!r}))
    sandbox.start()
    print(sandbox.uid, flush=True)
    await sandbox.run(["sh", "-c", "sleep 600 & sleep 600"], {{}})
asyncio.run(main())
"""
    trainer = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    uid = int(trainer.stdout.readline())
    time.sleep(1.0)
    assert uid in uids_running()
    assert [pid for pid in descendants(trainer.pid)
            if command(pid).endswith(f"-m trace_rl.machine.reaper {trainer.pid}")]
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 5
    while uid in uids_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uid not in uids_running()
    Sandbox(SandboxConfig(), "next", root=tmp_path).start()
    assert [path.name for path in tmp_path.iterdir()] == [f"{os.getpid()}-next"]


def uids_running() -> set[int]:
    """The uids of this host's live processes (zombies left out)."""
    from pathlib import Path

    found = set()
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if not fields.get("State", "").strip().startswith("Z"):
            found.add(int(fields["Uid"].split()[0]))
    return found


def test_on_routes_a_program_reaches_the_allowed_loopback_ports_only_after_setup(tmp_path):
    import socket
    import threading

    def server() -> int:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer():
            while True:
                connection, _ = listener.accept()
                connection.sendall(b"hello")
                connection.close()

        threading.Thread(target=answer, daemon=True).start()
        return listener.getsockname()[1]

    sampler, prefect = server(), server()  # the interception endpoint a harness may reach, and one it may not
    program = f"""
import socket
for port in ({sampler}, {prefect}):
    try:
        print(socket.create_connection(("127.0.0.1", port), timeout=2).recv(5).decode())
    except OSError as exc:
        print(type(exc).__name__)
"""
    sandbox = Sandbox(SandboxConfig(network="routes"), "routes", root=tmp_path)
    sandbox.start()

    async def play():
        setup = await sandbox.run(["python3", "-c", program], {})
        await sandbox.allow([sampler])
        execution = await sandbox.run(["python3", "-c", program], {})
        await sandbox.close()
        return setup, execution

    setup, execution = asyncio.run(play())
    assert setup.stdout.decode().split() == ["hello", "hello"]  # setup: the host's network
    assert execution.stdout.decode().split() == ["hello", "ConnectionRefusedError"]


def test_a_live_process_is_killed_through_verifiers_interface_without_touching_this_process(tmp_path):
    """verifiers kills a live process's group (`SubprocessProcess.kill`): a sandbox's is its own."""
    from trace_rl.sandbox.runtime import BwrapConfig, BwrapRuntime

    runtime = BwrapRuntime(BwrapConfig.of(SandboxConfig()), name="live")
    runtime.sandbox = Sandbox(SandboxConfig(), "live", root=tmp_path)

    async def play():
        await runtime.start()
        process = await runtime.open_process(["cat"], {})
        await process.write(b"echo\n")
        first = await anext(process.stdout)
        await process.kill()
        code = await process.wait()
        await runtime.stop()
        return first, code

    first, code = asyncio.run(play())
    assert first == b"echo\n" and code == -9


def test_a_host_path_under_the_hosts_tmp_stays_visible_read_only(tmp_path):
    """A checkout or venv under the host's /tmp (CI may clone there) is bound into the sandbox's own /tmp, not
    hidden by it: a program reads it there, cannot write it, and /tmp is otherwise the sandbox's own."""
    import tempfile

    host = tempfile.mkdtemp(dir="/tmp")
    Path(host).chmod(0o755)  # the sandbox's uid reads only what the world may read
    try:
        (Path(host) / "module.py").write_text("VALUE = 7\n")
        (Path(tempfile.gettempdir()) / "trace-rl-host-only").write_text("host")
        sandbox = Sandbox(SandboxConfig(read_only=[host]), "under-tmp", root=tmp_path)
        sandbox.start()
        script = (f"import os, sys; sys.path.insert(0, {host!r}); import module; print(module.VALUE); "
                  f"print(os.path.exists('/tmp/trace-rl-host-only')); "
                  f"open({host!r} + '/x', 'w')")
        outcome = asyncio.run(sandbox.run([sys.executable, "-c", script], {}))
        asyncio.run(sandbox.close())
        assert outcome.stdout.decode().split() == ["7", "False"], outcome.stderr
        assert outcome.exit_code != 0 and b"Read-only file system" in outcome.stderr
        assert sorted(p.name for p in Path(host).iterdir()) == ["module.py"]
    finally:
        shutil.rmtree(host)
        (Path(tempfile.gettempdir()) / "trace-rl-host-only").unlink(missing_ok=True)
