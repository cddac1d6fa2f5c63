from prefect import task

from trace_rl.config import Config
from trace_rl.pipeline import step as stages
from trace_rl.pipeline.session import session_for


@task(name="sample_rollouts", task_run_name="sample_rollouts")
def sample_rollouts_task(config: Config, step: int) -> dict:
    """Every env's groups with the actor, written to steps/<step>/traces.parquet."""
    return stages.sample_rollouts(session_for(config), step)
