"""A verifiers v1 taskset of one-line programs (configs/code.toml trains on it): each task asks for one line of
Python that prints a value (a product, a power, a sum of a range, a string reversed or counted); the task's
`@vf.metric` writes the reply's program to `solution.py` and runs `python3 solution.py` in the rollout's runtime,
as verifiers' own `code_golf` does, so the model's program runs in the sandbox, never on the host.

Reward: 1 when the program prints exactly the value; 0.25 when it runs cleanly and prints something else (a reply
that is a program at all, the first thing a small chat model learns here); 0 otherwise. 200 tasks, seeded."""

import random
import re

import verifiers.v1 as vf

ASK = "Write a one-line Python program that prints {what}. Reply with the code only."
WORDS = ["banana", "apple", "mississippi", "rocket", "teapot", "orange", "pepper", "coffee", "letter", "bottle"]
RUN_TIMEOUT_S = 10


def program(reply: str | None) -> str:
    """The reply's program: its first code block's body (to the reply's end where the block is not closed: a reply
    cut at the token limit), or the reply itself."""
    match = re.search(r"```(?:python|py)?\n(.*?)(?:```|$)", reply or "", re.DOTALL)
    return (match.group(1) if match else reply or "").strip()


def spec(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        return f"the product of {a} and {b}", str(a * b)
    if kind == 1:
        a, b = rng.randint(2, 9), rng.randint(5, 15)
        return f"{a} to the power of {b}", str(a ** b)
    if kind == 2:
        n = rng.randint(10, 200)
        return f"the sum of the integers from 1 to {n}", str(n * (n + 1) // 2)
    word = rng.choice(WORDS)
    if kind == 3:
        return f"the word '{word}' reversed", word[::-1]
    letter = rng.choice(sorted(set(word)))
    return f"how many times the letter '{letter}' occurs in '{word}'", str(word.count(letter))


class CodeData(vf.TaskData):
    expected: str = ""


class CodeTask(vf.Task[CodeData]):
    @vf.metric
    async def evaluate(self, trace: vf.Trace, runtime: vf.Runtime) -> dict[str, float]:
        """Run the reply's program once in the rollout's runtime."""
        source = program(trace.last_reply)
        if not source:
            return {"passed": 0.0, "ran": 0.0}
        await runtime.write("solution.py", source.encode())
        result = await runtime.run(["timeout", str(RUN_TIMEOUT_S), "python3", "solution.py"], {})
        ran = float(result.exit_code == 0 and bool(result.stdout.strip()))
        return {"passed": float(ran and result.stdout.strip() == self.data.expected), "ran": ran}

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if trace.metrics.get("passed") else 0.25 * trace.metrics.get("ran", 0.0)


class CodeTaskset(vf.Taskset[CodeTask]):
    def load(self):
        rng = random.Random(0)
        for _ in range(200):
            what, expected = spec(rng)
            yield CodeTask(CodeData(prompt=ASK.format(what=what), expected=expected), self.config.task)


__all__ = ["CodeData", "CodeTask", "CodeTaskset"]
