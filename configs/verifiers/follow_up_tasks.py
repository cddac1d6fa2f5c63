"""A multi-turn verifiers v1 env (configs/verifiers-follow-up.toml trains on it): the addition taskset with an env
of its own, in which the user asks a follow-up after the agent's answer ("Now add 1 to that."); the reward scores
the answer to the follow-up. The agent's two turns are one token sequence: its first answer is never re-tokenized."""

import verifiers.v1 as vf
from addition_tasks import AdditionTask, AdditionTaskset

from trace_rl.envs.rewards import math_match

FOLLOW_UP = "Now add 1 to that."


class FollowUpTask(AdditionTask):
    @vf.reward
    async def correct(self, trace) -> float:
        return math_match(trace.last_reply, str(int(self.data.answer) + 1))


class FollowUpTaskset(vf.Taskset[FollowUpTask]):
    def load(self):
        for task in AdditionTaskset(self.config).load():
            yield FollowUpTask(task.data, self.config.task)


class FollowUpConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class FollowUpEnv(vf.Env[FollowUpConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            await chat.turn(FOLLOW_UP)


__all__ = ["FollowUpEnv", "FollowUpTask", "FollowUpTaskset"]
