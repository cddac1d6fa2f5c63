from prefect import task

from trace_rl.config import Config
from trace_rl.pipeline import step as stages
from trace_rl.pipeline.session import session_for


@task(name="aggregate_channels", task_run_name="aggregate_channels")
def aggregate_channels_task(config: Config, step: int, channel_paths: list[str]) -> dict:
    """One training sample per branch, same-loss channels summed, into steps/<step>/aggregated.parquet."""
    return stages.aggregate_channels(session_for(config), step, channel_paths)
