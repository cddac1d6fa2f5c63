"""A multi-turn verifiers v1 env for the tests: the reverse taskset with an env of its own, in which a user asks a
follow-up after the agent's first reply; the task's reward scores the last reply."""

import verifiers.v1 as vf
from vf_reverse import ReverseTaskset

FOLLOW_UP = "Are you sure? Say it once more."


class FollowUpConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class FollowUpEnv(vf.Env[FollowUpConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            await chat.turn(FOLLOW_UP)


class FollowUpTaskset(ReverseTaskset):
    pass


__all__ = ["FollowUpEnv", "FollowUpTaskset"]
