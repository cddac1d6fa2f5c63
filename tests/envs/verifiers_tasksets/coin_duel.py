"""A two-seat verifiers v1 env whose seats default to verifiers' `null` harness (as kuhn_poker's do): each seat
calls a coin; the seat whose reply is shorter wins (zero-sum payoffs +1 / -1)."""

import verifiers.v1 as vf


class CoinDuelTaskset(vf.Taskset):
    def load(self):
        for i in range(4):
            yield vf.Task(vf.TaskData(prompt=f"Round {i}: heads or tails?"), self.config.task)


class CoinDuelConfig(vf.EnvConfig):
    player0: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})
    player1: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})


class CoinDuelEnv(vf.Env[CoinDuelConfig]):
    async def run(self, task, agents):
        first = await agents.player0.run(task)
        second = await agents.player1.run(task)
        won = 1.0 if len(first.last_reply or "") <= len(second.last_reply or "") else -1.0
        first.record_reward("payoff", won)
        second.record_reward("payoff", -won)


__all__ = ["CoinDuelConfig", "CoinDuelEnv", "CoinDuelTaskset"]
