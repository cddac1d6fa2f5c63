from prefect import task

from trace_rl.config import Config
from trace_rl.offline import replay
from trace_rl.pipeline.session import session_for
from trace_rl.pipeline.step import algorithm_jobs
from trace_rl.storage import RunStorage


@task(name="replay_step", task_run_name="replay-step-{step}")
def replay_step_task(config: Config, out_url: str, step: int, states: dict[str, dict]) -> dict:
    """One saved step's traces through the replay algorithms, into `<out>/steps/<step>/batch.parquet`."""
    out = RunStorage.from_url(out_url, config.storage_options)
    summary = replay.replay_step(session_for(config), out, step, algorithm_jobs(config), states)
    return {**summary, "states": states}
