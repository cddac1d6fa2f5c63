"""The bubblewrap command line of one sandboxed program: what it sees, who it runs as, its limits.

The host is bound read-only where a program needs it (/usr and its links, /etc, this Python and its
environment, `read_only`), nothing else: not /root, not /home, not the run's folders. The sandbox's
working folder and /tmp are host folders of its own, the only writable places. /proc is the sandbox's
own pid namespace (it sees its own processes only, so no other process's environment); the environment
is cleared (PATH, HOME = the working folder, LANG, TMPDIR, and what the caller passes). Network, IPC
and hostname are the sandbox's own unless `network = "host"`.

As root, bwrap mounts as root and the program then runs as a uid of its own (`setpriv`), with no
capability and no new privileges: a uid that owns nothing on the host, and whose RLIMIT_NPROC counts the
sandbox's processes only (root is exempt from RLIMIT_NPROC, so the limit needs another uid). As another
user, bwrap runs in a user namespace of that user's uid, and RLIMIT_NPROC counts all of that user's
processes.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from trace_rl.sandbox.config import MIB, SandboxConfig

# the uids sandboxes run as (root only): far above any real user's, one per live sandbox of a process
UID_BASE = 2_100_000_000
UID_SPAN = 1 << 20
LOCALE = "C.UTF-8"
# the host's variables a sandbox keeps: where the CA certificates are (a path, no secret), for TLS on `network = "host"`
PASSED = ("SSL_CERT_FILE", "SSL_CERT_DIR")
RELAY_DIR = "/run/trace-rl"  # in the sandbox: the relay of its allowed endpoints and the host's sockets


def bwrap_lack() -> str | None:
    """What this machine lacks to run a sandbox, or None."""
    if sys.platform != "linux":
        return "Linux (bubblewrap sandboxes need its namespaces)"
    if shutil.which("bwrap") is None:
        return "`bwrap` on PATH (apt-get install bubblewrap)"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "`setpriv` on PATH (apt-get install util-linux)"
    return None


class UidPool:
    """The uids of this process's live sandboxes: each sandbox its own, so that its process limit is its own."""

    def __init__(self):
        self.offset = (os.getpid() * 4096) % UID_SPAN
        self.live: set[int] = set()

    def take(self) -> int:
        index = 0
        while (uid := UID_BASE + (self.offset + index) % UID_SPAN) in self.live:
            index += 1
        self.live.add(uid)
        return uid

    def give_back(self, uid: int) -> None:
        self.live.discard(uid)


UIDS = UidPool()


def python_path() -> list[str]:
    """This process's PYTHONPATH: where an env's own modules are (`[[env]] import_paths`), for the tool servers."""
    return [os.path.abspath(path) for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]


def host_roots() -> list[str]:
    """The host paths every sandbox sees read-only: the system, this Python with its environment, PYTHONPATH."""
    roots = ["/usr", "/etc", "/opt", sys.base_prefix, sys.prefix, os.path.realpath(sys.prefix), *python_path()]
    return outermost(path for path in roots if os.path.exists(path))


def outermost(paths) -> list[str]:
    """`paths` without those inside another of them (bound with it already), in their first order."""
    paths = list(dict.fromkeys(os.path.abspath(path) for path in paths))
    return [path for path in paths if not any(Path(other) in Path(path).parents for other in paths)]


def bwrap_argv(argv: list[str], env: dict[str, str], config: SandboxConfig, workdir: Path, tmp: Path,
               uid: int | None, routes: list[int] | None = None, sockets: Path | None = None,
               server: bool = False, serves: list[int] = (), served: Path | None = None) -> list[str]:
    """The command that runs `argv` sandboxed, in `workdir` (its HOME too) with `tmp` as /tmp; as `uid` (root
    only: None runs it in a user namespace of the caller's uid). With `network = "routes"`: the host's network
    while `routes` is None (setup), else the host loopback ports `routes` only, relayed through `sockets`, and
    the ports `serves` of the sandbox's own loopback taken from unix sockets the relay makes in `served`. A
    `server` (a tool server living as long as its rollout, or its run) has no CPU time limit."""
    command = ["bwrap", "--die-with-parent", "--new-session", "--clearenv",
               "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    if uid is None:
        command.append("--unshare-user")
    relayed = config.network == "routes" and routes is not None
    if config.network == "none" or relayed:
        command.append("--unshare-net")
    for name in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            command += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            command += ["--ro-bind", str(path), str(path)]
    # /tmp first: a host path bound below it (a checkout, its venv, under the host's /tmp) lands in the sandbox's own
    command += ["--bind", str(tmp), "/tmp"]
    binds = outermost([*host_roots(), *config.read_only])
    # bwrap makes a bind's missing parents readable by root only; the sandbox's uid must pass through them
    for parent in dict.fromkeys(str(up) for path in [*binds, str(workdir)] for up in reversed(Path(path).parents)
                                if str(up) != "/"):
        command += ["--perms", "0755", "--dir", parent]
    for path in binds:
        command += ["--ro-bind", path, path]
    command += ["--dev", "/dev", "--proc", "/proc", "--bind", str(workdir), str(workdir), "--chdir", str(workdir)]
    if relayed and (routes or serves):
        command += ["--perms", "0755", "--dir", "/run", "--perms", "0755", "--dir", RELAY_DIR,
                    "--ro-bind", str(Path(__file__).with_name("forward.py")), f"{RELAY_DIR}/forward.py",
                    "--ro-bind", str(sockets), f"{RELAY_DIR}/sockets"]
        if serves:
            command += ["--bind", str(served), f"{RELAY_DIR}/served"]
        argv = [sys.executable, "-I", "-S", f"{RELAY_DIR}/forward.py", RELAY_DIR, ",".join(map(str, routes)),
                ",".join(map(str, serves)), "--", *argv]
    path = os.pathsep.join([str(Path(sys.prefix) / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    base = {"PATH": path, "HOME": str(workdir), "LANG": LOCALE, "TMPDIR": "/tmp",
            **{name: os.environ[name] for name in PASSED if name in os.environ}}
    if python_path():
        base["PYTHONPATH"] = os.pathsep.join(python_path())
    for name, value in {**base, **env}.items():
        command += ["--setenv", name, value]
    command.append("--")
    if uid is not None:
        command += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                    "--bounding-set=-all", "--no-new-privs", "--"]
    command += ["prlimit", f"--nproc={config.max_processes}", f"--cpu={'unlimited' if server else config.cpu_time_s}",
                f"--as={config.memory_mb * MIB}", f"--fsize={config.file_size_mb * MIB}",
                f"--nofile={config.open_files}", "--core=0", "--", *argv]
    return command
