"""Dynamic sampling ([[env]] drop_uniform_groups, refill_rounds): uniform groups are dropped before the
algorithms, refill rounds sample fresh groups deterministically, and both are reported per step."""

from __future__ import annotations

import asyncio
import random

import pytest

from trace_rl.config import Config, ConfigError
from trace_rl.data.trace import Trace, group_traces
from trace_rl.envs.base import Environment, Example, Sampler
from trace_rl.pipeline.rollouts import play_rollouts
from trace_rl.runs.loading import validate_config

ENV = "tests.envs.test_dynamic_sampling:Coin"


class Coin(Environment):
    """No model: an example is `uniform` (every rollout rewarded 1) or not (the parity of the rollout's seed
    decides 0 or 1: mostly mixed, uniform by chance)."""

    id = "coin"

    def make_example(self, rng: random.Random) -> dict:
        return {"uniform": rng.random() < 0.5}

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        reward = 1.0 if example.data["uniform"] else float(sampler.seed % 2)
        return [Trace(id="", env=self.id, example_id=example.id, group_id="", reward=reward,
                      info={"seed": sampler.seed})]


def config(**env) -> Config:
    return Config(name="dynamic", seed=1, env=[{"id": ENV, "batch_size": 8, "group_size": 4, **env}])


class NoModel:
    policy_step = 0


def run(config: Config, step: int = 1):
    return asyncio.run(play_rollouts(config, {"policy": NoModel()}, step))


def uniform(traces: list[Trace]) -> list[str]:
    return [gid for gid, group in group_traces(traces).items() if len({t.reward for t in group}) == 1]


def test_off_by_default_every_group_is_kept_and_nothing_more_is_reported():
    traces, summary = run(config())
    assert len(group_traces(traces)) == 8 and uniform(traces)  # some groups are uniform, and kept
    assert not any(key.endswith(("dropped_groups", "refill_rounds")) for key in summary.metrics())


def test_uniform_groups_are_dropped_and_reported():
    everything, _ = run(config())
    traces, summary = run(config(drop_uniform_groups=True))
    groups = group_traces(traces)
    assert uniform(traces) == []
    dropped = len(uniform(everything))
    assert 0 < dropped < 8 and len(groups) == 8 - dropped
    # the kept groups are exactly the non-uniform ones of the same sampling, in order
    assert list(groups) == [gid for gid in group_traces(everything) if gid not in uniform(everything)]
    metrics = summary.metrics()
    assert metrics["rollouts/" + ENV + "/groups"] == 8 - dropped
    assert metrics["rollouts/" + ENV + "/dropped_groups"] == dropped
    assert metrics["rollouts/" + ENV + "/refill_rounds"] == 0
    assert metrics["rollouts/" + ENV + "/traces"] == 32  # what was sampled


def test_refill_rounds_fill_the_batch_deterministically():
    traces, summary = run(config(drop_uniform_groups=True, refill_rounds=6))
    groups = group_traces(traces)
    assert len(groups) == 8 and uniform(traces) == []
    assert any("-refill1-" in gid for gid in groups)
    metrics = summary.metrics()
    rounds = metrics["rollouts/" + ENV + "/refill_rounds"]
    assert 1 <= rounds <= 6 and metrics["rollouts/" + ENV + "/groups"] == 8
    assert metrics["rollouts/" + ENV + "/traces"] == 4 * (8 + metrics["rollouts/" + ENV + "/dropped_groups"])
    again, _ = run(config(drop_uniform_groups=True, refill_rounds=6))  # a resumed step samples the same
    assert [(t.id, t.reward, t.info) for t in again] == [(t.id, t.reward, t.info) for t in traces]
    other, _ = run(config(drop_uniform_groups=True, refill_rounds=6), step=2)
    assert [t.example_id for t in other] != [t.example_id for t in traces]


def test_one_refill_round_may_leave_the_batch_short():
    traces, summary = run(config(drop_uniform_groups=True, refill_rounds=1))
    metrics = summary.metrics()
    assert metrics["rollouts/" + ENV + "/refill_rounds"] == 1
    assert metrics["rollouts/" + ENV + "/groups"] == len(group_traces(traces)) <= 8


@pytest.mark.parametrize("env, expected", [
    ({"refill_rounds": 2}, "refill_rounds refills the groups drop_uniform_groups drops"),
    ({"drop_uniform_groups": True, "group_size": 1}, "drop_uniform_groups with group_size = 1 drops every group"),
])
def test_inconsistent_dynamic_sampling_is_refused(env, expected):
    with pytest.raises(ConfigError) as info:
        validate_config({"name": "run", "env": [{"id": "reverse-text", **env}]})
    assert any(expected in p for p in info.value.problems), info.value.problems
