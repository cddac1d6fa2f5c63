"""A verifiers v1 taskset (configs/verifiers-math.toml trains on it): single-digit addition, "What is 3 + 4?", all
100 pairs, scored by math-verify against the sum. The run puts this folder on sys.path (`[[env]] import_paths`), so
its id is the module's name, as `vf.load_environment` resolves taskset ids."""

import verifiers.v1 as vf

from trace_rl.envs.rewards import math_match


class AdditionData(vf.TaskData):
    answer: str = ""


class AdditionTask(vf.Task[AdditionData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return math_match(trace.last_reply, self.data.answer)


class AdditionTaskset(vf.Taskset[AdditionTask]):
    def load(self):
        for a in range(10):
            for b in range(10):
                yield AdditionTask(AdditionData(prompt=f"What is {a} + {b}?", answer=str(a + b)), self.config.task)


__all__ = ["AdditionData", "AdditionTask", "AdditionTaskset"]
