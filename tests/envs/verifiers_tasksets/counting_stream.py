"""An infinite verifiers v1 taskset (`INFINITE = True`): task i asks for the number after a seeded one, forever."""

import random

import verifiers.v1 as vf


class CountingConfig(vf.TasksetConfig):
    seed: int = 0


class CountingTask(vf.Task):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(str(self.data.answer) in (trace.last_reply or ""))


class CountingData(vf.TaskData):
    answer: int


class CountingStream(vf.Taskset[vf.Task[CountingData], CountingConfig]):
    INFINITE = True

    def load(self):
        rng = random.Random(self.config.seed)
        while True:
            number = rng.randint(0, 999)
            yield vf.Task(CountingData(prompt=f"What number comes after {number}?", answer=number + 1),
                          self.config.task)


__all__ = ["CountingConfig", "CountingStream"]
