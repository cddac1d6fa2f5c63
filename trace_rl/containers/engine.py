"""Whether a container engine runs containers on this machine, said in one line that names the fix; and the
containers a killed trainer left behind.

Debian 12's podman 4.3 on a host with hybrid (v1) cgroups runs containers only with `runc` and the `cgroupfs`
cgroup manager: crun refuses hybrid cgroups, and the systemd manager needs systemd as init (docs/containers.md#podman).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from trace_rl.containers.image import BUILD, INSTALL, image_exists

SCOPE_PREFIX = "trace-rl-"
CONFIGURE = ('/etc/containers/containers.conf: [containers] default_ulimits = [], [engine] runtime = "runc", '
             'cgroup_manager = "cgroupfs" (docs/containers.md#podman)')


def engine_problem(engine: str) -> str | None:
    """What `engine` lacks here to run a container, or None."""
    if shutil.which(engine) is None:
        return f"`{engine}` on PATH ({INSTALL[engine]}, then `{BUILD[engine]}`)"
    if engine == "docker":
        result = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
        if result.returncode != 0:
            return (f"a running docker daemon that this user may use (`docker info` failed: "
                    f"{(result.stderr.strip().splitlines() or ['?'])[-1]})")
        return None
    result = subprocess.run(["podman", "info", "--format", "json"], capture_output=True, text=True)
    if result.returncode != 0:
        return f"a working podman (`podman info` failed: {(result.stderr.strip().splitlines() or ['?'])[-1]})"
    host = json.loads(result.stdout)["host"]
    runtime = host.get("ociRuntime", {}).get("name")
    if host.get("cgroupVersion") == "v1" and runtime != "runc":
        return f"podman on runc (its OCI runtime {runtime} cannot run containers on v1 cgroups): {CONFIGURE}"
    if host.get("cgroupManager") == "systemd" and not os.path.isdir("/run/systemd/system"):
        return f"podman's cgroup manager set to cgroupfs (systemd is not this machine's init): {CONFIGURE}"
    return None


def image_problem(engine: str, image: str, default: bool) -> str | None:
    """Why `image` cannot start here, or None: it is not in the engine's store (no registry is assumed)."""
    if image_exists(image, engine):
        return None
    if default:
        return f"{engine}'s default image {image} is not built: run `{BUILD[engine]}`"
    return (f"{engine} has no image {image!r} (`{engine} images` lists its store; no registry is assumed: build it "
            "here, docs/containers.md#images)")


def claim_scope() -> None:
    """Name this process's verifiers run scope after it, `trace-rl-<pid>-<start time>` (unless `VF_RUN_ID` names
    one): verifiers labels each container it starts with it (`verifiers.run`), so the containers of a process that
    is gone are known (`sweep`)."""
    from trace_rl.machine.processes import stat

    os.environ.setdefault("VF_RUN_ID", f"{SCOPE_PREFIX}{os.getpid()}-{stat(os.getpid()).start}")


def sweep(engine: str) -> list[str]:
    """Remove the containers of trace-rl processes that are gone (a SIGKILLed run's rollouts in flight: verifiers
    removes a container when its rollout ends, which a killed process never reaches). Returns their names."""
    from trace_rl.machine.processes import is_alive

    listed = subprocess.run([engine, "ps", "-a", "--filter", "label=verifiers.run", "--format",
                             '{{.Names}} {{index .Labels "verifiers.run"}}'], capture_output=True, text=True)
    orphans = []
    for line in listed.stdout.splitlines():
        container, _, scope = line.partition(" ")
        pid, _, start = scope.removeprefix(SCOPE_PREFIX).partition("-")
        if scope.startswith(SCOPE_PREFIX) and pid.isdigit() and start.isdigit() and not is_alive(int(pid), int(start)):
            orphans.append(container)
    if orphans:
        subprocess.run([engine, "rm", "--force", *orphans], capture_output=True)
    return orphans
