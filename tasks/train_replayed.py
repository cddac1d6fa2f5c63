from prefect import task

from trace_rl.config import Config
from trace_rl.storage import RunStorage


@task(name="train_replayed")
def train_replayed(config: Config, steps: list[int]) -> list[dict]:
    """Train `config.model` offline on the replayed batches, one optimizer step per replayed step."""
    from trace_rl.trainer.run import train_one_step
    from trace_rl.trainer.trainer import Trainer

    storage = RunStorage(config.storage, config.name, config.storage_options)
    trainer = Trainer(config, storage)
    trainer.restore()
    return [{"step": step, **train_one_step(config, storage, step, trainer=trainer)} for step in steps]
