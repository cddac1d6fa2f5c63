"""`SandboxConfig`: the limits and the network of one sandbox (docs/sandbox.md#keys)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MIB = 1024 * 1024


class SandboxConfig(BaseModel):
    """What a program in the sandbox may use. Every limit holds per program (one `run`), except `disk_mb` and
    `max_processes`, which hold for the whole sandbox (a rollout's working folder and its /tmp, its uid)."""

    model_config = ConfigDict(extra="forbid")

    network: Literal["none", "routes", "host"] = "none"
    """`none`: a network namespace of its own (loopback only, nothing outside). `routes`: the host's network while
    verifiers sets the rollout up (a harness installs its program), then only the endpoints verifiers routes to
    the harness (the sampler's interception endpoint, MCP servers), relayed onto the sandbox's own loopback.
    `host`: the host's network, which includes servers on the host's 127.0.0.1 (the Prefect API)."""
    max_processes: int = Field(1000, gt=0)
    """RLIMIT_NPROC of the sandbox's own uid (its processes and threads together)."""
    wall_time_s: float = Field(300.0, gt=0)
    """A program still running after this many seconds is killed, with everything it started."""
    cpu_time_s: int = Field(300, gt=0)
    """RLIMIT_CPU of each process, in CPU seconds."""
    memory_mb: int = Field(4096, gt=0)
    """RLIMIT_AS of each process (its address space), in MiB."""
    file_size_mb: int = Field(256, gt=0)
    """RLIMIT_FSIZE: the largest file a process may write, in MiB."""
    disk_mb: int = Field(1024, gt=0)
    """What the working folder and /tmp may hold together, in MiB; a program over it is killed."""
    output_bytes: int = Field(8 * MIB, gt=0)
    """Bytes read from a program's stdout and stderr together; a program that writes more is killed."""
    open_files: int = Field(1024, gt=0)
    """RLIMIT_NOFILE of each process."""
    read_only: list[str] = Field(default_factory=list)
    """More host paths the sandbox sees, read-only, at the same place (a data set, a tool)."""
