from prefect import task

from trace_rl.config import Config
from trace_rl.pipeline import step as stages
from trace_rl.pipeline.session import session_for


@task(name="validate_dimensions", task_run_name="validate_dimensions")
def validate_dimensions_task(config: Config, step: int, channel_paths: list[str]) -> dict:
    """Every channel checked against its branch; a failure names env, trace, branch and algorithm."""
    return stages.validate_dimensions(session_for(config), step, channel_paths)
