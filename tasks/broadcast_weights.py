from prefect import task

from trace_rl.config import Config
from trace_rl.pipeline import step as stages
from trace_rl.pipeline.session import session_for


@task(name="broadcast_weights", task_run_name="broadcast_weights")
def broadcast_weights_task(config: Config, step: int) -> dict:
    """The actor samples with weights/<step> from the next step on."""
    return stages.broadcast_weights(session_for(config), step)
