from prefect import task

from trace_rl.config import Config
from trace_rl.storage import RunStorage
from trace_rl.trainer.lifecycle import RunTrainer


@task(name="train_replayed")
def train_replayed_task(config: Config, steps: list[int]) -> list[dict]:
    """Train `config.model` offline on the replayed batches, one optimizer step per replayed step."""
    with RunTrainer(config, RunStorage.of(config)) as trainer:
        return [{"step": step, **metrics} for step, metrics in zip(steps, trainer.run_steps(steps))]
