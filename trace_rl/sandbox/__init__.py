"""The sandbox: every program a rollout runs (a task's `runtime.run`, a harness's commands, a tool server) runs
under bubblewrap, never on the host unless a config says so (docs/sandbox.md).

Public surface:
- `SandboxConfig`: the limits and network (`none`, `routes`, `host`) of a sandbox; its keys are a seat's
  `runtime = { type = "bwrap", ... }` in a verifiers env's `[env.args]`.
- `Sandbox(config, name)`: one rollout's sandbox; `start()`, `await run(argv, env)` -> `Outcome` (exit code,
  output, the limit that killed it), `await spawn(...)` for a live process, `await allow(ports)` (the host
  loopback ports a `routes` network reaches from now on), `await serve(port)` and `await expose(port)` (a port
  the sandbox serves on its own loopback, and the host loopback port that reaches it), `await close()`.
- `bwrap_lack()`: what this machine lacks to run a sandbox (None: nothing).
- `trace_rl.sandbox.runtime` (imports verifiers): `BwrapConfig` (a seat's sandbox, a `SubprocessConfig` to
  verifiers), `HostConfig` (a seat on the host), `BwrapRuntime` (verifiers' runtime on a Sandbox) and `install()`
  (verifiers builds a BwrapRuntime for every subprocess runtime but a HostConfig).
"""

from trace_rl.sandbox.bwrap import bwrap_lack
from trace_rl.sandbox.config import SandboxConfig
from trace_rl.sandbox.sandbox import KILLED, Outcome, Sandbox

__all__ = ["KILLED", "Outcome", "Sandbox", "SandboxConfig", "bwrap_lack"]
