"""A verifiers v1 taskset whose tasks serve a task-scoped MCP tool (`echo_say`), as verifiers' glossary does."""

import verifiers.v1 as vf


class EchoToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "echo"

    @vf.tool
    def say(self, text: str) -> str:
        """Say the text back."""
        return text


class ToolTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ToolTask(vf.Task[vf.TaskData, vf.State, ToolTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolTaskConfig) -> list[vf.Toolset]:
        return [EchoToolset(config.tools)]

    @vf.reward
    async def said(self, trace) -> float:
        return float("hello" in (trace.last_reply or ""))


class ToolTasksetConfig(vf.TasksetConfig):
    task: ToolTaskConfig = ToolTaskConfig()


class ToolTaskset(vf.Taskset[ToolTask, ToolTasksetConfig]):
    def load(self):
        for i in range(2):
            yield ToolTask(vf.TaskData(prompt=f"Use echo_say to say hello {i}."), self.config.task)


__all__ = ["EchoToolset", "ToolTask", "ToolTaskset", "ToolTasksetConfig"]
