"""The sandbox: every program a rollout runs (a task's `runtime.run`, a harness's commands, a colocated tool
server) runs under bubblewrap, never on the host (docs/sandbox.md).

Public surface:
- `SandboxConfig`: the limits and network of a sandbox (its keys are a seat's `runtime = { type = "bwrap", ... }`).
- `Sandbox(config, name)`: one rollout's sandbox; `start()`, `await run(argv, env)` -> `Outcome` (exit code,
  output, the limit that killed it), `await spawn(...)` for a long-lived process, `await close()`.
- `bwrap_lack()`: what this machine lacks to run a sandbox (None: nothing).
- `trace_rl.sandbox.runtime` (imports verifiers): `BwrapConfig`, `BwrapRuntime`, `install()`, verifiers' runtime
  on a Sandbox.
"""

from trace_rl.sandbox.bwrap import bwrap_lack
from trace_rl.sandbox.config import SandboxConfig
from trace_rl.sandbox.sandbox import KILLED, Outcome, Sandbox

__all__ = ["KILLED", "Outcome", "Sandbox", "SandboxConfig", "bwrap_lack"]
