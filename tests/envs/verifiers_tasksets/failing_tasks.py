"""A verifiers v1 taskset whose reward fails on every other task: the tests' failed episodes."""

import verifiers.v1 as vf


class FailingTask(vf.Task):
    @vf.reward
    async def scored(self, trace) -> float:
        if self.data.idx % 2:
            raise RuntimeError(f"task {self.data.idx} cannot be scored")
        return 1.0


class FailingTaskset(vf.Taskset[FailingTask]):
    def load(self):
        for i in range(4):
            yield FailingTask(vf.TaskData(prompt=f"Say {i}."), self.config.task)


__all__ = ["FailingTask", "FailingTaskset"]
