from prefect import task

from trace_rl.config import Config
from trace_rl.pipeline import step as stages
from trace_rl.pipeline.session import session_for


@task(name="train", task_run_name="train")
def train_task(config: Config, step: int, algorithm_states: dict[str, str]) -> dict:
    """One optimizer step; checkpoints/<step> and weights/<step>, each STABLE."""
    return stages.train(session_for(config), step, algorithm_states)
