"""verifiers' podman runtime in one container a rollout, with no network device: the rollout's routes are its only
way out.

verifiers 0.4.0 starts three containers for a rollout whose network is restricted: the rollout's own, on podman's
bridge with a published port; a helper in its network that hands verifiers' egress proxy a listener there; and one
more that cuts the network with iptables before the agent runs. Each costs a `podman run` (and the bridge's set-up
and tear-down), which made podman 0.38x the host's rollouts/s. Where podman runs as root, trace-rl's runtime starts
the rollout's container with `--network none` (loopback only: nothing to cut) and makes the proxy's listener in the
container's network namespace from this process (`setns` in a thread of its own), so a rollout costs one `podman
run` and one `podman rm`; its programs run with `runc exec` (podman's own exec, less podman's and conmon's start).
What a rollout may reach is what verifiers' proxy lets through: the routes of its interception endpoint and tool
servers, and the hosts of the seat's `allow`, from its set-up on (verifiers opens set-up to every host; here it
needs none, docs/containers.md#network). A seat with the network open (`allow = ["*"]`), and rootless podman, run
verifiers' runtime as it is.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import os
import socket
import subprocess
import threading
import uuid

from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import parse_gpu
from verifiers.v1.runtimes.container import cli
from verifiers.v1.runtimes.docker import PodmanRuntime
from verifiers.v1.runtimes.docker.egress import EgressProxy, NetworkPolicy

CLONE_NEWNET = 0x40000000
PROXY_PORT = 3128  # the egress proxy's port on each container's loopback (a network namespace of its own)
RUNC_ROOT = "/run/runc"  # runc's state of root's containers, where podman's runc keeps them


def listener_in(pid: int, port: int) -> socket.socket:
    """A TCP listener on 127.0.0.1:`port` in the network namespace of process `pid`, for this process to serve: made
    in a thread that enters that namespace and then ends (a namespace is a thread's own)."""
    made: dict[str, object] = {}

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/proc/{pid}/ns/net") as namespace:
                if libc.setns(namespace.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into the network of process {pid}")
            listener = socket.socket()
            listener.bind(("127.0.0.1", port))
            listener.listen()
            made["listener"] = listener
        except OSError as exc:
            made["error"] = exc

    thread = threading.Thread(target=make, name="trace-rl-netns")
    thread.start()
    thread.join()
    if "error" in made:
        raise SandboxError(f"podman proxy listener failed: {made['error']}")
    return made["listener"]


class RoutedPodmanRuntime(PodmanRuntime):
    """verifiers' PodmanRuntime for a restricted network where podman runs as root: one container, `--network none`,
    the egress proxy listening in it from its start.

    `start` returns at once, the container starting beside the rollout's set-up and first turns (its routes are
    known without it: the proxy's port is fixed); the first command run in it waits for it, and fails with the
    start's error (`podman run failed: ...`, a retryable rollout) if it did not start."""

    _id: str | None = None  # the container's full id, runc's name for it
    _starting: asyncio.Future | None = None

    async def start(self) -> None:
        self._container = f"vf-{uuid.uuid4().hex}"
        self._proxy = EgressProxy(NetworkPolicy(self.config, []))
        self._proxy.port = PROXY_PORT
        self._cut = True  # no device but loopback: the proxy is the only way out, for set-up too
        self._starting = asyncio.ensure_future(self._start_container())

    async def started(self) -> None:
        if self._starting is not None:
            await asyncio.shield(self._starting)

    async def _start_container(self) -> None:
        options = ["--network", "none", "--http-proxy=false", "--cap-drop", "NET_ADMIN", "--cap-drop", "NET_RAW",
                   "--security-opt", "no-new-privileges"]
        if self.config.cpu is not None:
            options += ["--cpus", str(self.config.cpu)]
        if self.config.memory is not None:
            options += ["--memory", f"{self.config.memory}g"]
        _, gpus = parse_gpu(self.config.gpu)
        options += [arg for index in range(gpus) for arg in ("--device", f"nvidia.com/gpu={index}")]
        env = [arg for key, value in self.env.items() for arg in ("--env", f"{key}={value}")]
        run = await cli(self.engine, "run", *self._label_args, "--detach", *options, *env, "--entrypoint", "sleep",
                        "--name", self._container, self.config.image, "infinity")
        if run.exit_code != 0:
            raise SandboxError(f"{self.engine} run failed: {run.stderr.strip()}")
        self._id = run.stdout.strip()
        self.info.id = self._id[:12]
        inspected = await cli(self.engine, "inspect", "--format", "{{.State.Pid}} {{json .Config}}", self._container)
        pid, _, config = inspected.stdout.partition(" ")
        if inspected.exit_code != 0 or not pid.isdigit():
            raise SandboxError(f"{self.engine} inspection failed: {inspected.stderr.strip()}")
        container = json.loads(config)
        self._image_env = dict(entry.split("=", 1) for entry in container["Env"] or [])
        # the image's shell in the container's files, as root, before anything of the rollout ran there
        made = await cli("nsenter", "--target", pid, "--mount", "--", "sh", "-c",
                         'if [ ! -d "$1" ]; then mkdir -p "$1" && chown "$2" "$1"; fi', "vf-workdir",
                         self.config.workdir, container["User"] or "0")
        if made.exit_code != 0:
            raise SandboxError(f"{self.engine} workdir setup failed: {made.stderr.strip()}")
        await self._proxy.start(listener=listener_in(int(pid), PROXY_PORT))

    async def _run_host(self, *argv: str):
        await self.started()
        return await super()._run_host(*argv)

    async def _communicate_host(self, *argv: str, input: bytes | None = None):
        await self.started()
        return await super()._communicate_host(*argv, input=input)

    async def open_process(self, argv: list[str], env: dict[str, str]):
        await self.started()
        return await super().open_process(argv, env)

    async def teardown(self) -> None:
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        await super().teardown()

    def _exec(self, env: dict[str, str], *, stdin: bool = False) -> list[str]:
        """`runc exec` into the container where podman runs it on runc (a third of `podman exec`'s time: no podman
        process, no conmon): the process gets the container's spec (its capabilities, seccomp profile, user,
        no_new_privileges) as with `podman exec`; its environment is set by `env` in the container."""
        if self.user is not None or self._id is None or not os.path.isdir(f"{RUNC_ROOT}/{self._id}"):
            return super()._exec(env, stdin=stdin)
        env = {**env, **self._proxy_env()}
        return ["runc", "--root", RUNC_ROOT, "exec", "--cwd", self.config.workdir, self._id, "env",
                *(f"{key}={value}" for key, value in env.items())]


_rootful: bool | None = None


def rootful() -> bool:
    """Whether podman runs as root here (its containers' namespaces are this process's to enter)."""
    global _rootful
    if _rootful is None:
        result = subprocess.run(["podman", "info", "--format", "{{.Host.Security.Rootless}}"], capture_output=True,
                                text=True)
        _rootful = os.geteuid() == 0 and result.stdout.strip() == "false"
    return _rootful


def install() -> None:
    """Make verifiers start a restricted podman seat's rollouts in a RoutedPodmanRuntime where podman runs as root
    (idempotent)."""
    import verifiers.v1.runtimes as runtimes

    original = runtimes._runtime_cls
    if getattr(original, "trace_rl_podman", False):
        return

    @functools.wraps(original)  # keeps the marks of trace_rl.sandbox.runtime.install
    def runtime_cls(config):
        chosen = original(config)
        if chosen is PodmanRuntime and config.network_restricted and rootful():
            return RoutedPodmanRuntime
        return chosen

    runtime_cls.trace_rl_podman = True
    runtimes._runtime_cls = runtime_cls
