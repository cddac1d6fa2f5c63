"""A verifiers v1 taskset whose reward runs a program in the rollout's runtime, as `code_golf` runs the model's
answer: task i runs PROGRAMS[i] (`python3 solution.py`) and is rewarded 1.0 when it exits 0; a program that fails
or is killed at a limit fails the scoring, so its episode fails."""

import verifiers.v1 as vf

PROGRAMS = [
    "import os; print(os.getuid(), os.getcwd())",  # a program that works
    "while True: pass",  # an infinite loop: killed at the wall time
]


class ProgramTask(vf.Task):
    @vf.reward
    async def ran(self, trace, runtime) -> float:
        await runtime.write("solution.py", PROGRAMS[self.data.idx].encode())
        result = await runtime.run(["python3", "solution.py"], {})
        if result.exit_code != 0:
            raise RuntimeError(f"the program failed ({result.exit_code}): {result.stderr.strip()[-200:]}")
        trace.record_metric("output", float(len(result.stdout)))
        return 1.0


class ProgramTaskset(vf.Taskset[ProgramTask]):
    def load(self):
        for i in range(len(PROGRAMS)):
            yield ProgramTask(vf.TaskData(prompt=f"Say {i}."), self.config.task)


__all__ = ["ProgramTask", "ProgramTaskset"]
