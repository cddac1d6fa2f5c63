from prefect import task

from trace_rl.config import Config
from trace_rl.pipeline import step as stages
from trace_rl.pipeline.session import session_for


@task(name="run_algorithm", task_run_name="{job.config.id}")
def run_algorithm_task(config: Config, step: int, job: stages.AlgorithmJob) -> dict:
    """One algorithm (builtin in-process, or env-owned on its env server) over its envs' traces."""
    return stages.run_algorithm(session_for(config), step, job)
