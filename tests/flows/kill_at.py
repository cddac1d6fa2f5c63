"""`python -m tests.flows.kill_at POINT STEP ARGS...`: trace-rl's CLI (`flows.cli ARGS...`) in a process that SIGKILLs
its own process group at one named point of step STEP, so a crash test kills a run exactly there instead of polling
its files from outside (which misses the points that write nothing, or only for milliseconds).

The points, in the order a step passes them (with `[async]` the sampling of step s runs beside the training of
step s - 1):

    sample       sampling step s with partial rollouts: after its first round of segments, nothing stored yet
    in_flight    the rollouts step s leaves in flight stored (steps/<s>/in_flight.json), its traces not yet
    algorithm    an algorithm's channels of step s written, its task not recorded as finished
    validate     the channels of step s validated, the task not recorded
    aggregate    aggregated.parquet of step s written, the task not recorded
    write_batch  batch.parquet of step s written, the task not recorded
    train        the train task of step s started, nothing trained (the next step's sampling runs beside it)
    checkpoint   every part of the checkpoint of step s written, its STABLE marker not
"""

from __future__ import annotations

import functools
import os
import signal
import sys


def kill() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)


def kill_at_stage(name: str, step: int, before: bool) -> None:
    """Kill on the call of stage `name` (trace_rl.pipeline.step, called as (session, step, ...)) for `step`:
    when it starts, or once it returned."""
    from trace_rl.pipeline import step as stages

    stage = getattr(stages, name)

    @functools.wraps(stage)
    def killing(session, at: int, *args, **kwargs):
        if at == step and before:
            kill()
        result = stage(session, at, *args, **kwargs)
        if at == step:
            kill()
        return result

    setattr(stages, name, killing)


def kill_while_sampling(step: int) -> None:
    """Kill when the first round of segments of step `step`'s partial rollouts is sampled."""
    from trace_rl.pipeline import partial

    sampling = {"step": None}
    new_rollouts, gather = partial.new_rollouts, partial.gather_or_cancel

    def starting(config, at: int):  # called once as each step's sampling starts
        sampling["step"] = at
        return new_rollouts(config, at)

    async def one_round(coroutines):
        result = await gather(coroutines)
        if sampling["step"] == step:
            kill()
        return result

    partial.new_rollouts, partial.gather_or_cancel = starting, one_round


def kill_before_traces(step: int) -> None:
    from trace_rl.pipeline import step as stages

    write_traces = stages.write_traces

    def killing(storage, at: int, traces):
        if at == step:
            kill()
        return write_traces(storage, at, traces)

    stages.write_traces = killing


def kill_before_stable_checkpoint(step: int) -> None:
    from trace_rl.storage import RunStorage, step_name

    mark_stable = RunStorage.mark_stable

    def marking(self, directory: str) -> None:
        if directory == self.path("checkpoints", step_name(step)):
            kill()
        mark_stable(self, directory)

    RunStorage.mark_stable = marking


STAGES = {"algorithm": "run_algorithm", "validate": "validate_dimensions", "aggregate": "aggregate_channels",
          "write_batch": "write_batch"}


def install(point: str, step: int) -> None:
    if point == "sample":
        kill_while_sampling(step)
    elif point == "in_flight":
        kill_before_traces(step)
    elif point == "train":
        kill_at_stage("train", step, before=True)
    elif point == "checkpoint":
        kill_before_stable_checkpoint(step)
    else:
        kill_at_stage(STAGES[point], step, before=False)


if __name__ == "__main__":
    point, step, *argv = sys.argv[1:]
    install(point, int(step))
    from flows.cli import main

    sys.exit(main(argv))
