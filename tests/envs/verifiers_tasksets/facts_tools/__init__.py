"""A verifiers v1 taskset with task-scoped MCP tools (a `vf.Toolset` served by a subprocess verifiers starts per
rollout): the tests' tool episodes. The task asks for a fact that only the `facts_lookup` tool knows; the reward is
whether the last reply holds it. `facts_crash` ends its server's process, `facts_wait` sleeps for the seconds it
is given (the harness's `tool_timeout` cuts it short), `facts_reach` tells whether the server connects to a
port of 127.0.0.1."""

import verifiers.v1 as vf

from facts_tools.server import FACTS, FactsToolset


class FactsTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class FactsTaskData(vf.TaskData):
    answer: str


class FactsTask(vf.Task[FactsTaskData, vf.State, FactsTaskConfig]):
    @classmethod
    def toolsets(cls, config: FactsTaskConfig) -> list[vf.Toolset]:
        return [FactsToolset(config.tools)]

    @vf.reward
    async def found(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))


class FactsConfig(vf.TasksetConfig):
    task: FactsTaskConfig = FactsTaskConfig()


class FactsTaskset(vf.Taskset[FactsTask, FactsConfig]):
    def load(self):
        for i, (key, fact) in enumerate(FACTS.items()):
            yield FactsTask(FactsTaskData(idx=i, prompt=f"What is {key}? Look it up.", answer=fact),
                            self.config.task)


__all__ = ["FactsTask", "FactsTaskset"]
