"""A verifiers v1 taskset that declares its episodes cannot be driven again (as one whose tools act on a sandbox
would): trace-rl refuses partial rollouts on it."""

from tool_tasks import ToolTask, ToolTaskset


class SandboxedTaskset(ToolTaskset):
    drivable_again = False


__all__ = ["SandboxedTaskset", "ToolTask"]
