"""A verifiers v1 taskset for the tests: reverse a short word; the reward is the share of the answer's characters
the reply gets right, position by position (so the tiny model's replies differ in reward)."""

import verifiers.v1 as vf

WORDS = ["abc", "hello", "xyz", "cat", "lamp", "river"]


class ReverseData(vf.TaskData):
    answer: str = ""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward
    async def matched(self, trace) -> float:
        reply, answer = trace.last_reply, self.data.answer
        return sum(a == b for a, b in zip(reply, answer)) / len(answer)

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class ReverseTaskset(vf.Taskset[ReverseTask]):
    def load(self):
        for word in WORDS:
            yield ReverseTask(ReverseData(prompt=f"Reverse: {word}", answer=word[::-1]), self.config.task)


__all__ = ["ReverseData", "ReverseTask", "ReverseTaskset"]
