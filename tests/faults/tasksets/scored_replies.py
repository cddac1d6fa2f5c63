"""A verifiers v1 taskset whose every reward is a program in the rollout's sandbox (the default runtime of
trace-rl's chat harness): it scores the reply (the share of its characters that are letters), leaves a daemon
behind and takes half a second, so a run killed mid-step has sandboxes running, each with a child of its own."""

import verifiers.v1 as vf

SCORE = """
import subprocess, time
subprocess.Popen(["sleep", "600"], start_new_session=True)  # a daemon: it dies with its program's sandbox
time.sleep(0.5)
reply = open("reply.txt").read()
print(sum(c.isalpha() for c in reply) / max(len(reply), 1))
"""
WORDS = ["oak", "tin", "sea", "owl"]


class ScoredTask(vf.Task):
    @vf.reward
    async def letters(self, trace, runtime) -> float:
        await runtime.write("reply.txt", (trace.last_reply or "").encode())
        await runtime.write("score.py", SCORE.encode())
        result = await runtime.run(["python3", "score.py"], {})
        if result.exit_code != 0:
            raise RuntimeError(f"the scoring program failed ({result.exit_code}): {result.stderr.strip()[-200:]}")
        return float(result.stdout)


class ScoredTaskset(vf.Taskset[ScoredTask]):
    def load(self):
        for word in WORDS:
            yield ScoredTask(vf.TaskData(prompt=f"Say {word}."), self.config.task)


__all__ = ["ScoredTask", "ScoredTaskset"]
