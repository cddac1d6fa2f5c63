"""Running algorithms on traces: annotations in, channels out.

Algorithms are simple mutators of `branch.advantages`/`branch.mask`. The runner clears
every branch of a group before an algorithm sees it, runs it, turns what it set into
`Channel`s and clears the annotations again, so nothing depends on annotations
surviving a copy and no algorithm sees another's output. A branch marked untrainable
(`Branch.trainable`) yields no channel, whatever the algorithm set on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trace_rl.algorithms.base import Algorithm, AlgorithmConfig, AlgorithmError
from trace_rl.aio import gather_or_cancel
from trace_rl.algorithms.lookup import load_algorithm
from trace_rl.data.channel import Channel
from trace_rl.data.trace import Trace, group_traces


def clear(traces: list[Trace]) -> None:
    for trace in traces:
        for branch in trace.branches:
            branch.clear_annotations()


def collect(algorithm: Algorithm, traces: list[Trace]) -> list[Channel]:
    """One channel per trainable branch the algorithm annotated; setting only one of advantages/mask is an error."""
    channels = []
    for trace in traces:
        for branch in trace.branches:
            if not branch.trainable or (branch.advantages is None and branch.mask is None):
                continue
            if branch.advantages is None or branch.mask is None:
                missing = "mask" if branch.mask is None else "advantages"
                raise AlgorithmError(
                    f"algorithm {algorithm.id!r} set only one of advantages/mask on trace {trace.id!r} "
                    f"branch {branch.index}: {missing} is None; set both or neither"
                )
            channels.append(Channel(
                algorithm_id=algorithm.id, loss=algorithm.loss, trace_id=trace.id, branch_index=branch.index,
                values=np.asarray(branch.advantages, np.float32), mask=np.asarray(branch.mask, np.bool_),
            ))
    return channels


async def run_on_group(algorithm: Algorithm, group: list[Trace]) -> list[Channel]:
    clear(group)
    try:
        await algorithm.advantage(group)
        return collect(algorithm, group)
    finally:
        clear(group)


async def apply_algorithm(algorithm: Algorithm, traces: list[Trace]) -> list[Channel]:
    """Run `algorithm` on every group of `traces` (groups concurrently, or all in one call for a `per_trace` or
    `whole_step` algorithm) and return its channels, group by group."""
    groups = group_traces(traces).values()
    if algorithm.per_trace or algorithm.whole_step:
        return await run_on_group(algorithm, [trace for group in groups for trace in group])
    per_group = await gather_or_cancel(run_on_group(algorithm, group) for group in groups)
    return [channel for channels in per_group for channel in channels]


async def load_algorithms(
    configs: Sequence[AlgorithmConfig | Mapping[str, Any] | str],
    models: Mapping[str, Any],
    states: Sequence[dict[str, Any]] | None = None,
) -> list[Algorithm]:
    """Build each algorithm, bind its models and, when resuming, restore its checkpointed state."""
    algorithms = [load_algorithm(config) for config in configs]
    if states is not None and len(states) != len(algorithms):
        raise AlgorithmError(f"got {len(states)} algorithm states for {len(algorithms)} algorithms")
    for position, algorithm in enumerate(algorithms):
        await algorithm.setup(models)
        if states is not None:
            algorithm.load_state_dict(states[position])
    return algorithms


async def apply_algorithms(algorithms: Sequence[Algorithm], traces: list[Trace]) -> dict[int, list[Channel]]:
    """Run each algorithm in turn; channels keyed by the algorithm's position in the list."""
    return {position: await apply_algorithm(algorithm, traces) for position, algorithm in enumerate(algorithms)}
