"""hierarchical_grpo: solvers compared within their proposed problem, proposers across the group's proposals."""

from __future__ import annotations

import pytest

from tests.algorithms.helpers import reward_trace, run
from trace_rl.algorithms import AlgorithmError, load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.data.trace import rollout_of, rollout_trace_id

HIERARCHICAL = {"id": "hierarchical_grpo", "episode_agents": ["solver"]}


def played(group: str, rollouts: list[tuple[float, list[float]]]) -> list:
    """The traces of `rollouts` (proposer reward, solver rewards) of one group, named as the rollout loop names
    them."""
    traces = []
    for rollout, (proposer, solvers) in enumerate(rollouts):
        traces.append(reward_trace(rollout_trace_id(group, rollout, "proposer"), proposer, group=group,
                                   agent="proposer"))
        traces += [reward_trace(rollout_trace_id(group, rollout, "solver", play), reward, group=group, agent="solver")
                   for play, reward in enumerate(solvers)]
    return traces


def advantages(spec, traces) -> dict[str, float]:
    return {c.trace_id: float(c.values[5]) for c in run(apply_algorithm(load_algorithm(spec), traces))}


def test_solvers_are_compared_on_their_problem_and_proposers_across_proposals():
    traces = played("g", [(8 / 9, [1.0, 1.0, 0.0]), (0.0, [0.0, 0.0, 0.0]), (1.0, [1.0, 0.0])])
    assert advantages(HIERARCHICAL, traces) == pytest.approx({  # by hand
        # problem 0: solver mean 2/3; problem 1: mean 0; problem 2: mean 1/2
        "g-r0-solver": 1 / 3, "g-r0-solver-1": 1 / 3, "g-r0-solver-2": -2 / 3,
        "g-r1-solver": 0.0, "g-r1-solver-1": 0.0, "g-r1-solver-2": 0.0,
        "g-r2-solver": 0.5, "g-r2-solver-1": -0.5,
        # proposers 8/9, 0, 1: mean 17/27
        "g-r0-proposer": 7 / 27, "g-r1-proposer": -17 / 27, "g-r2-proposer": 10 / 27}, abs=1e-7)
    # grpo pools the solvers of every problem (mean 3/8): an easy problem's solvers look good
    assert advantages("grpo", traces)["g-r0-solver"] == 0.625


def test_groups_errored_traces_and_lone_peers():
    traces = played("g1", [(1.0, [1.0, 0.0]), (0.0, [1.0])]) + played("g2", [(0.5, [0.0, 1.0])])
    traces[1].error = "timeout"  # g1-r0-solver: no signal, does not shift its problem's mean
    got = advantages(HIERARCHICAL, traces)
    assert "g1-r0-solver" not in got and got["g1-r0-solver-1"] == 0.0  # alone on its problem now
    assert got["g1-r1-solver"] == 0.0  # a problem with one solver
    assert got["g1-r0-proposer"] == 0.5 and got["g1-r1-proposer"] == -0.5
    assert got["g2-r0-proposer"] == 0.0 and got["g2-r0-solver"] == -0.5 and got["g2-r0-solver-1"] == 0.5


def test_an_episode_agent_whose_trace_id_names_no_rollout_is_refused():
    traces = [reward_trace("replayed-1", 1.0, agent="solver"), reward_trace("replayed-2", 0.0, agent="solver")]
    assert rollout_of(traces[0]) is None
    with pytest.raises(AlgorithmError, match="trace 'replayed-1' has no rollout in its id.*use grpo"):
        advantages(HIERARCHICAL, traces)
    with pytest.raises(AlgorithmError, match="episode_agents: Field required"):
        load_algorithm("hierarchical_grpo")
