"""`trace-rl serve`: the train, eval and replay flows as deployments served from this process (`prefect.serve`).

Runs started from the UI (or on the cron schedule) execute here, so a deployment run is one
long training run whose steps are subflows, with the model loaded once.
"""

from __future__ import annotations

from prefect import serve

from flows.eval import eval_flow
from flows.replay import replay_flow
from flows.train import train_flow
from trace_rl.config import Config


def serve_config(config: Config, cron: str | None = None) -> None:
    training = train_flow.to_deployment(
        name=config.name,
        parameters={"config": config.model_dump(mode="json"), "mode": "resume"},
        cron=cron,
        description=f"Train {config.name}: {config.steps} steps; edit the config in the run form.",
        enforce_parameter_schema=True,
    )
    replaying = replay_flow.to_deployment(
        name=f"{config.name}-replay",
        description="Replay saved traces of a run through new algorithms into new batches.",
        enforce_parameter_schema=True,
    )
    evaluating = eval_flow.to_deployment(
        name=f"{config.name}-eval",
        parameters={"config": config.model_dump(mode="json"), "step": config.steps},
        description=f"Evaluate the weights of one step of {config.name} on its [eval] envs (docs/eval.md).",
        enforce_parameter_schema=True,
    )
    serve(training, evaluating, replaying)
