"""verifiers' runtime in the sandbox: a seat's `runtime = { type = "bwrap", ... }` (the keys of `SandboxConfig`)
runs every program of its rollouts (`runtime.run`, a harness's commands, a colocated tool server) in a
`trace_rl.sandbox.Sandbox` of the rollout.

verifiers 0.4.0 has a closed set of runtime types, and its records (the agent's config on each trace, which
an env server sends back) must parse in any verifiers. So trace-rl hands verifiers a `BwrapConfig`: a
`SubprocessConfig` (type `subprocess` on the wire: local, no image, as verifiers checks a subprocess seat)
whose sandbox settings ride beside its fields, and `install()` makes verifiers build a `BwrapRuntime` for it.

Fail-safe: once installed, verifiers builds a BwrapRuntime for every subprocess runtime but a `HostConfig` (a
seat that said `type = "subprocess"`): a tool server verifiers starts on its own subprocess runtime, or a seat
config verifiers re-read from its fields (which drops the sandbox settings), runs sandboxed with
`TOOLS_SANDBOX`, never on the host. Its network is a namespace of its own from the start: a tool server listens
on `SERVED_PORT` of the sandbox's own loopback, which the host reaches through a port of its loopback (`expose`,
the URL verifiers hands the harness), and reaches only the host URLs verifiers routes through `host_url` (the
rollout's state channel). A taskset whose tool servers need more says so (`tools_network`, docs/sandbox.md).

The runtime keeps the subprocess runtime's interface: a working folder on the host that verifiers reads and
writes directly (`write`, `read`), and that the sandbox sees at the same path.
"""

from __future__ import annotations

import asyncio
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from pydantic import PrivateAttr
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes import ProgramResult, RuntimeProcess
from verifiers.v1.runtimes.base import Runtime
from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessProcess, SubprocessRuntime

from trace_rl.sandbox.config import SandboxConfig
from trace_rl.sandbox.sandbox import Sandbox

TYPE = "bwrap"


class BwrapConfig(SubprocessConfig):
    """verifiers' config of a sandboxed seat: `sandbox` holds its SandboxConfig (not serialized)."""

    _sandbox: SandboxConfig = PrivateAttr(default_factory=SandboxConfig)

    @classmethod
    def of(cls, sandbox: SandboxConfig) -> BwrapConfig:
        config = cls()
        config._sandbox = sandbox
        return config

    @property
    def sandbox(self) -> SandboxConfig:
        return self._sandbox


class HostConfig(SubprocessConfig):
    """verifiers' config of a seat that runs on the host (`runtime = { type = "subprocess" }`, said explicitly)."""


TOOLS_SANDBOX = SandboxConfig(network="routes")
SERVED_PORT = 8000  # where a tool server listens on its sandbox's own loopback: no host port is taken


def text(data: bytes) -> str:
    return data.decode(errors="replace")


class BwrapRuntime(SubprocessRuntime):
    """A rollout's sandbox as verifiers' runtime: its working folder is `workdir`, its /tmp the sandbox's."""

    scripts_dir = Runtime.scripts_dir  # in the sandbox's own /tmp, not the host's cache

    def __init__(self, config: SubprocessConfig, name: str | None = None) -> None:
        super().__init__(config, name)
        self._uv_interpreters, self._uv_script_locks = {}, {}  # each sandbox prepares its scripts in its own /tmp
        self.sandbox = Sandbox(config.sandbox if isinstance(config, BwrapConfig) else TOOLS_SANDBOX, self.name)
        # not a seat's: a tool server's runtime, whose network is its routes from the start
        self.serves_tools = not isinstance(config, BwrapConfig) and self.sandbox.config.network == "routes"
        self.tool_routes: set[int] = set()

    async def start(self) -> None:
        await asyncio.to_thread(self.sandbox.start)
        self.workdir = self.sandbox.workdir
        self.info.id = str(self.workdir)
        if self.serves_tools:
            await self.sandbox.allow([])

    @property
    def published_port(self) -> int | None:
        """A tool server's port: verifiers has it listen there (on the sandbox's own loopback) and `expose` it."""
        return SERVED_PORT if self.serves_tools else None

    async def expose(self, port: int) -> str:
        if not self.serves_tools:
            return await super().expose(port)
        return f"http://127.0.0.1:{await self.sandbox.expose(port)}"

    def host_url(self, url: str) -> str:
        """A tool server's runtime is handed the host URLs its server reaches (the rollout's state channel): each
        becomes a route, at the same URL on the sandbox's own loopback."""
        if self.serves_tools:
            self.tool_routes.update(loopback_ports([url]))
        return url

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        outcome = await self.sandbox.run(argv, self.process_env(env))
        return ProgramResult(exit_code=outcome.exit_code, stdout=text(outcome.stdout), stderr=text(outcome.stderr))

    async def open_process(self, argv: list[str], env: dict[str, str]) -> RuntimeProcess:
        process = await self.sandbox.spawn(argv, self.process_env(env), stdin=asyncio.subprocess.PIPE,
                                           stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return SubprocessProcess(process)

    async def run_background(self, argv: list[str], env: dict[str, str], log: str) -> None:
        if self.serves_tools:
            await self.sandbox.serve(SERVED_PORT)
            await self.sandbox.allow(sorted(self.tool_routes))
        with self.host_path(log).open("wb") as file:
            await self.sandbox.spawn(argv, self.process_env(env), server=True, stdin=asyncio.subprocess.DEVNULL,
                                     stdout=file, stderr=asyncio.subprocess.STDOUT)

    async def prepare_execution(self, routes: list[str] | None) -> None:
        """verifiers' last setup step: with `network = "routes"`, cut the network down to the host loopback
        endpoints of `routes` (None: the host's network again, for another setup)."""
        if self.sandbox.config.network == "routes":
            await self.sandbox.allow(None if routes is None else loopback_ports(routes))

    def host_path(self, path: str) -> Path:
        """Where a path of the sandbox's working folder or /tmp lies on the host; a SandboxError for any other."""
        inner = PurePosixPath(path)
        if not inner.is_absolute():
            return self.sandbox.workdir / inner
        for place, host in ((PurePosixPath(self.sandbox.workdir), self.sandbox.workdir),
                            (PurePosixPath("/tmp"), self.sandbox.tmp)):
            if inner == place or place in inner.parents:
                return host / inner.relative_to(place)
        raise SandboxError(f"{path!r} is outside the sandbox's writable folders (its working folder and /tmp)")

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        try:
            target = self.host_path(path)
        except SandboxError:  # a read-only host file the sandbox sees: read it as the sandbox does
            return await Runtime._read(self, path, max_bytes if max_bytes is not None else 1 << 30)
        try:
            with target.open("rb") as file:
                return await asyncio.to_thread(file.read, -1 if max_bytes is None else max_bytes)
        except OSError as exc:
            raise SandboxError(f"read {path!r}: {exc}") from exc

    async def write(self, path: str, data: bytes) -> None:
        target = self.host_path(path)
        base = self.sandbox.tmp if self.sandbox.tmp in target.parents else self.sandbox.workdir
        await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(target.write_bytes, data)
        for made in [target, *target.relative_to(base).parents]:  # the file and the folders made for it
            if made != Path("."):
                self.sandbox.own(base / made if made is not target else target)

    async def teardown(self) -> None:
        await self.sandbox.close()

    def cleanup(self) -> None:
        self.sandbox.remove()


def loopback_ports(urls: list[str]) -> list[int]:
    """The ports of the URLs on this host's loopback (the others are not reachable from a sandbox)."""
    ports = []
    for url in urls:
        parts = urlsplit(url)
        if parts.hostname in ("127.0.0.1", "localhost") and parts.port:
            ports.append(parts.port)
    return ports


def install() -> None:
    """Make verifiers build a BwrapRuntime for every subprocess runtime but a HostConfig (idempotent)."""
    import verifiers.v1.runtimes as runtimes

    original = runtimes._runtime_cls
    if getattr(original, "trace_rl_bwrap", False):
        return

    def runtime_cls(config):
        if isinstance(config, SubprocessConfig) and not isinstance(config, HostConfig):
            return BwrapRuntime
        return original(config)

    runtime_cls.trace_rl_bwrap = True
    runtimes._runtime_cls = runtime_cls


