"""`Sandbox`: one rollout's sandbox, its folders and its uid; `run` runs one program in it, to its end or to
a limit.

A program runs in a bwrap of its own (`trace_rl.sandbox.bwrap`), in the sandbox's pid namespace of that run:
when the program exits, everything it started dies with it (a daemon cannot outlive it), and when its
runner kills it (a limit), bwrap and every process in it die (`--die-with-parent`). The folders live in
`<root>/<pid>-<name>/` (`work/`, `tmp/`, `sockets/`, the host's ends of the relays of a `routes`
network, and `served/`, the sandbox's ends of the ports it serves); `close()` removes them, and the next
sandbox to start removes those of processes that no longer run (a run killed by SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trace_rl.machine import reaper
from trace_rl.sandbox.bwrap import UIDS, bwrap_argv
from trace_rl.sandbox.config import MIB, SandboxConfig

KILLED = 137  # the exit code of a program killed at a limit, as a shell reports a SIGKILL
DISK_POLL_S = 0.2
GONE_POLL_S = 0.01
GONE_WAIT_S = 10.0
CHUNK = 64 * 1024


def default_root() -> Path:
    """Where sandboxes keep their folders: not under /tmp, which a sandbox's own /tmp hides."""
    base = Path("/var/tmp")
    return (base if base.is_dir() else Path(tempfile.gettempdir())) / "trace-rl-sandboxes"


@dataclass(frozen=True)
class Outcome:
    """How a program ended: its exit code (KILLED when its runner killed it), its output (at most the
    sandbox's `output_bytes` together), and which limit killed it (None: it ended by itself)."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    limit: str | None = None


def folder_bytes(path: Path, stop_above: int) -> int:
    """The bytes of the files under `path` (their allocated blocks), counted until past `stop_above`."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
        if total > stop_above:
            break
    return total


def read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    return data


def running(pid: int) -> bool:
    """Whether `pid` still runs. A sandbox's init that exited is a zombie until the host's init reaps it; the
    kernel killed and reaped the rest of its pid namespace before it became one."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: int | Path) -> None:
    """Relay one connection to the host's 127.0.0.1:`target` (a port), or to the unix socket `target` (a path)
    where a sandbox serves a port: only a socket, as a link the sandbox put there could lead anywhere on the host."""
    try:
        if isinstance(target, Path):
            if not stat.S_ISSOCK(os.lstat(target).st_mode):
                raise OSError(f"{target} is not a socket")
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(str(target))
        else:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        writer.close()
        return
    await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def closed_after(process: asyncio.subprocess.Process, listener: asyncio.AbstractServer) -> None:
    await process.wait()
    listener.close()


def sweep(root: Path) -> None:
    """Remove the sandbox folders of processes that no longer run."""
    if not root.is_dir():
        return
    for folder in root.iterdir():
        owner = reaper.folder_owner(folder.name)
        if owner is not None and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(folder, ignore_errors=True)


class Sandbox:
    """`Sandbox(config, name)`; `start()` makes its folders, `await run(argv, env)` -> Outcome, `close()`
    removes them. `workdir` (the program's working folder and HOME) and `tmp` (its /tmp) are host folders."""

    def __init__(self, config: SandboxConfig, name: str, root: Path | None = None):
        self.config = config
        self.folder = (root or default_root()) / f"{os.getpid()}-{name}"
        self.workdir = self.folder / "work"
        self.tmp = self.folder / "tmp"
        self.sockets = self.folder / "sockets"
        self.served = self.folder / "served"
        self.uid: int | None = None
        self.processes: list[asyncio.subprocess.Process] = []
        self.routes: list[int] | None = None
        self.serves: list[int] = []
        self.relays: dict[int, asyncio.AbstractServer] = {}
        self.exposed: dict[int, asyncio.AbstractServer] = {}
        self.server: asyncio.subprocess.Process | None = None  # the last `server` program spawned
        self.watches: list[asyncio.Future] = []

    def start(self) -> None:
        """Make the sandbox's folders (sweeping those of processes gone) and start this process's reaper, which kills
        its sandboxes when it dies, even one bwrap has not yet bound to it (trace_rl.machine.reaper)."""
        reaper.start()
        root = self.folder.parent
        root.mkdir(mode=0o711, parents=True, exist_ok=True)
        sweep(root)
        self.folder.mkdir(mode=0o711)
        self.workdir.mkdir(mode=0o700)
        self.sockets.mkdir(mode=0o755)
        self.served.mkdir(mode=0o700)
        self.tmp.mkdir()
        self.tmp.chmod(0o1777)
        if os.geteuid() == 0:
            self.uid = UIDS.take()
            os.chown(self.workdir, self.uid, self.uid)
            os.chown(self.served, self.uid, self.uid)

    def own(self, path: Path) -> None:
        """Give a file the host wrote into the working folder to the sandbox's uid (it may rewrite it)."""
        if self.uid is not None:
            with contextlib.suppress(OSError):
                os.chown(path, self.uid, self.uid, follow_symlinks=False)

    def argv(self, argv: list[str], env: dict[str, str], server: bool = False) -> list[str]:
        serves = self.serves if server else []
        routes = None if self.routes is None else [port for port in self.routes if port not in serves]
        return bwrap_argv(argv, env, self.config, self.workdir, self.tmp, self.uid, routes, self.sockets,
                          server, serves, self.served)

    async def allow(self, ports: list[int] | None) -> None:
        """With `network = "routes"`: from now on, programs reach the host's loopback `ports` only (None: the
        host's network again, for setup), and the ports the sandbox serves (`serve`). Each port is relayed from a
        unix socket in `sockets`."""
        self.routes = None if ports is None else sorted({*ports, *self.serves})
        for port in self.routes or []:
            if port not in self.relays:
                path = self.sockets / str(port)
                target = self.served / str(port) if port in self.serves else port
                self.relays[port] = await asyncio.start_unix_server(
                    lambda reader, writer, target=target: relay(reader, writer, target), path=str(path))
                path.chmod(0o666)

    async def serve(self, port: int) -> None:
        """With `network = "routes"`: the next `server` program listens on `port` of the sandbox's own loopback
        (a tool server); the programs after it reach it there, and `expose` makes it reachable from the host.
        The server's own relay takes its connections from the unix socket `served/<port>`."""
        self.serves = sorted({*self.serves, port})
        await self.allow(self.routes or [])

    async def expose(self, port: int) -> int:
        """The host loopback port that reaches the sandbox's served `port` (`serve`)."""
        if port not in self.exposed:
            listener = await asyncio.start_server(
                lambda reader, writer: relay(reader, writer, self.served / str(port)), "127.0.0.1", 0)
            self.exposed[port] = listener
            if self.server is not None:  # once the server ends, its port refuses connections, as a host server's
                self.watches.append(asyncio.ensure_future(closed_after(self.server, listener)))
        return self.exposed[port].sockets[0].getsockname()[1]

    async def spawn(self, argv: list[str], env: dict[str, str], server: bool = False,
                    **streams) -> asyncio.subprocess.Process:
        """Start `argv` in the sandbox (killed at `close()` if still running; a `server` has no CPU time limit).
        bwrap reports the host pid of the sandbox's init (`process.init_pid`): once it is gone, so is every
        process of the program."""
        status, report = os.pipe()
        try:
            command = self.argv(argv, env, server)
            command[1:1] = ["--info-fd", str(report)]
            # a process group of its own: verifiers signals a live process's group (`SubprocessProcess.kill`); where
            # this process dies before bwrap has bound the sandbox to it (--die-with-parent), its reaper (`start`)
            # kills the sandbox, found by its working folder
            process = await asyncio.create_subprocess_exec(*command, env={"LANG": "C.UTF-8"}, pass_fds=(report,),
                                                           process_group=0, **streams)
            os.close(report)
            report = -1
            info = await asyncio.to_thread(read_all, status)  # bwrap closes it once the sandbox has started
        finally:
            os.close(status)
            if report >= 0:
                os.close(report)
        process.init_pid = json.loads(info)["child-pid"] if info.startswith(b"{") else None
        self.processes.append(process)
        if server:
            self.server = process
        return process

    async def run(self, argv: list[str], env: dict[str, str], stdin: bytes | None = None) -> Outcome:
        """Run `argv` to its end or to a limit (wall time, output bytes, disk); a cancelled run kills it."""
        config = self.config
        process = await self.spawn(argv, env, stdin=asyncio.subprocess.PIPE if stdin is not None else
                                   asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                   stderr=asyncio.subprocess.PIPE)
        output = {"stdout": bytearray(), "stderr": bytearray()}
        over: list[str] = []

        def stop(limit: str) -> None:
            over.append(limit)
            self.kill(process)

        async def read(name: str, stream: asyncio.StreamReader) -> None:
            while chunk := await stream.read(CHUNK):  # to EOF: asyncio's wait() waits for the pipes to close
                room = config.output_bytes - len(output["stdout"]) - len(output["stderr"])
                output[name] += chunk[:max(room, 0)]
                if len(chunk) > room and not over:
                    stop(f"output over {config.output_bytes} bytes")

        async def watch_disk() -> None:
            limit = config.disk_mb * MIB
            while True:
                await asyncio.sleep(DISK_POLL_S)
                if await asyncio.to_thread(folder_bytes, self.folder, limit) > limit:
                    stop(f"disk over {config.disk_mb} MiB")
                    return

        async def ended() -> None:
            if stdin is not None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    process.stdin.write(stdin)
                    await process.stdin.drain()
                process.stdin.close()
            await asyncio.gather(read("stdout", process.stdout), read("stderr", process.stderr))
            await process.wait()

        watcher = asyncio.ensure_future(watch_disk())
        try:
            try:
                await asyncio.wait_for(asyncio.shield(ending := asyncio.ensure_future(ended())), config.wall_time_s)
            except TimeoutError:
                stop(f"wall time over {config.wall_time_s:g} s")
                await ending
        finally:
            watcher.cancel()
            self.kill(process)
            await asyncio.gather(watcher, return_exceptions=True)
            await self.gone(process)
            self.processes.remove(process)
        if over:
            note = f"\nsandbox: program killed: {over[0]}\n".encode()
            return Outcome(KILLED, bytes(output["stdout"]), bytes(output["stderr"]) + note, over[0])
        stderr = bytes(output["stderr"])
        if process.returncode < 0:  # bwrap itself died by a signal: from outside, its programs cannot reach it
            stderr += f"\nsandbox: the sandbox was killed from outside (signal {-process.returncode})\n".encode()
        return Outcome(process.returncode, bytes(output["stdout"]), stderr)

    @staticmethod
    def kill(process: asyncio.subprocess.Process) -> None:
        """SIGKILL bwrap and the sandbox's init, and with it every process of the program (its pid namespace)."""
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        if process.init_pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.init_pid, signal.SIGKILL)

    @staticmethod
    async def gone(process: asyncio.subprocess.Process) -> None:
        """Wait until the program's processes are gone: its init exits once the kernel has killed the rest."""
        await process.wait()
        for _ in range(int(GONE_WAIT_S / GONE_POLL_S)):  # bounded: the pid may be reused once it is gone
            if process.init_pid is None or not running(process.init_pid):
                return
            await asyncio.sleep(GONE_POLL_S)

    async def close(self) -> None:
        for server in [*self.relays.values(), *self.exposed.values()]:
            server.close()
        self.relays, self.exposed = {}, {}
        for process in self.processes:
            self.kill(process)
        await asyncio.gather(*(self.gone(process) for process in self.processes), *self.watches,
                             return_exceptions=True)
        self.processes, self.watches, self.server = [], [], None
        self.remove()

    def remove(self) -> None:
        """Remove the folders and give the uid back (synchronous: also at interpreter exit)."""
        for process in self.processes:
            self.kill(process)
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.uid is not None:
            UIDS.give_back(self.uid)
            self.uid = None
