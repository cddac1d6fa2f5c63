"""hierarchical_grpo on the rollout loop: one rollout of the proposer-solver env is one proposed problem."""

from __future__ import annotations

import numpy as np

from tests.algorithms.helpers import run
from tests.envs.proposer_solver import ProposerSolver
from trace_rl.algorithms import load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.config import Config
from trace_rl.data.trace import rollout_of
from trace_rl.pipeline.rollouts import play_rollouts

HIERARCHICAL = {"id": "hierarchical_grpo", "episode_agents": ["solver"]}


def test_on_the_rollout_loop_a_proposed_problem_is_one_rollout(hf_runtime):
    config = Config(name="proposer-solver", seed=3, sampling={"max_completion_tokens": 6},
                    env=[{"id": f"{ProposerSolver.__module__}:ProposerSolver", "batch_size": 2, "group_size": 3,
                          "args": {"solvers": 3}}])
    traces, _ = run(play_rollouts(config, {"policy": hf_runtime}, step=1))
    assert len(traces) == 2 * 3 * 4
    channels = {c.trace_id: c for c in run(apply_algorithm(load_algorithm(HIERARCHICAL), traces))}
    by_id = {t.id: t for t in traces}
    for trace in traces:  # recomputed from the ids the loop gave: the same rollout, or the group for a proposer
        peers = [t.reward for t in traces if t.agent == trace.agent and t.group_id == trace.group_id
                 and (trace.agent == "proposer" or rollout_of(t) == rollout_of(trace))]
        expected = trace.reward - np.mean(peers)
        np.testing.assert_allclose(channels[trace.id].values[channels[trace.id].mask], expected, atol=1e-7)
    solver_ids = sorted(i for i in by_id if i.startswith(traces[0].group_id + "-r0-solver"))
    assert [i.removeprefix(traces[0].group_id + "-r0-") for i in solver_ids] == ["solver", "solver-1", "solver-2"]
    assert len({t.reward for t in traces if t.agent == "solver"}) == 2  # both outcomes occur: the check can fail
    assert any(abs(c.values).max() > 0 for c in channels.values())
