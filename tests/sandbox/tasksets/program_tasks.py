"""A verifiers v1 taskset whose reward runs a program in the rollout's runtime, as `code_golf` runs the model's
answer: task i writes PROGRAMS[i] to solution.py, runs `python3 solution.py` and is rewarded 1.0 when it exits 0;
a program that fails, or is killed at a limit, fails the scoring and so the episode."""

import verifiers.v1 as vf

PROGRAMS = [
    # works in a sandbox only: it sees none of the trainer's environment, and works in a sandbox's folder
    "import os, sys\nsys.exit(0 if 'TRACE_RL_FAKE_SECRET' not in os.environ and 'trace-rl-sandboxes' in os.getcwd()"
    " else 1)",
    "import sys\nfor _ in range(300):\n    sys.stdout.write('x' * (1 << 20))",  # 300 MB on stdout
]


class ProgramTask(vf.Task):
    @vf.reward
    async def ran(self, trace, runtime) -> float:
        await runtime.write("solution.py", PROGRAMS[self.data.idx].encode())
        result = await runtime.run(["python3", "solution.py"], {})
        if result.exit_code != 0:
            raise RuntimeError(f"the program failed ({result.exit_code}): {result.stderr.strip()[-200:]}")
        return 1.0


class ProgramTaskset(vf.Taskset[ProgramTask]):
    def load(self):
        for i in range(len(PROGRAMS)):
            yield ProgramTask(vf.TaskData(prompt=f"Say {i}."), self.config.task)


__all__ = ["ProgramTask", "ProgramTaskset"]
