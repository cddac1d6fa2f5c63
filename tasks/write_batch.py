from prefect import task

from trace_rl.config import Config
from trace_rl.pipeline import step as stages
from trace_rl.pipeline.session import session_for


@task(name="write_batch", task_run_name="write_batch")
def write_batch_task(config: Config, step: int, aggregated: str) -> dict:
    """steps/<step>/batch.parquet in the run's storage, from the aggregated samples."""
    return stages.write_batch(session_for(config), step, aggregated)
