"""The per-process runtime of a run: model runtimes and the trainer, kept warm between steps.

Pipeline stages ask the session for what they need at a step; whatever is missing
(a fresh process after a crash, a retried flow run) is rebuilt from storage: the
sampler loads the latest exported weights before step `s` samples, and the trainer
restores the checkpoint of step `s - 1` before training step `s` (`trace_rl.trainer.lifecycle.RunTrainer`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from trace_rl.config import Config, config_hash
from trace_rl.inference.build import BaseModelView, build_runtime
from trace_rl.models.runtime import TORCH_STATE_LOCK, ModelRuntime
from trace_rl.names import POLICY
from trace_rl.pipeline.colocation import models_in_use, runtime_configs
from trace_rl.pipeline.schedule import sampling_weights
from trace_rl.storage import RunStorage
from trace_rl.trainer.lifecycle import RunTrainer


class LazyRuntimes(Mapping):
    """Runtimes by key, each built on first access (an algorithm that never asks costs nothing)."""

    def __init__(self, config: Config):
        self._configs = runtime_configs(config)
        self._built: dict[str, ModelRuntime] = {}

    def __getitem__(self, key: str) -> ModelRuntime:
        if key not in self._built:
            config = self._configs[key]
            if config.base_of:  # the LoRA policy's base model: the policy's runtime without its adapter
                self._built[key] = BaseModelView(config, self[config.base_of])
            else:
                with TORCH_STATE_LOCK:
                    self._built[key] = build_runtime(config)
        return self._built[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._configs)

    def __len__(self) -> int:
        return len(self._configs)

    def is_built(self, key: str) -> bool:
        return key in self._built

    def built(self) -> list[ModelRuntime]:
        return list(self._built.values())

    @property
    def configs(self):
        return self._configs


class Session:
    def __init__(self, config: Config):
        self.config = config
        self.storage = RunStorage.of(config)
        self.runtimes = LazyRuntimes(config)
        self.uses_policy = POLICY in models_in_use(config)  # else no policy engine is started, nor reloaded
        self.trainer = RunTrainer(config, self.storage)  # kept warm between steps
        self._policy_step: int | None = None

    async def models_at(self, step: int) -> LazyRuntimes:
        """The runtimes, awake, with the policy (if built or the actor) sampling the weights that step `step` uses."""
        await self.wake_engines()  # asleep only if a step failed between its train and broadcast stages
        if self.config.actor == POLICY or self.runtimes.is_built(POLICY):
            await self.sync_policy(step)
        return self.runtimes

    async def models_for(self, step: int, keys: set[str]) -> dict[str, ModelRuntime]:
        """Just the runtimes `keys` names, awake; the policy among them runs the weights step `step` samples with.
        No keys: nothing is built, woken or loaded (a replayed `grpo` needs no model and no weights)."""
        if not keys:
            return {}
        await self.wake_engines()
        if POLICY in keys:
            await self.sync_policy(step)
        return {key: self.runtimes[key] for key in sorted(keys)}

    @property
    def policy_step(self) -> int | None:
        """The step whose weights the policy runtime runs (0: the base model; None: not loaded yet)."""
        return self._policy_step

    async def sleep_engines(self) -> None:
        """Colocated in-process vLLM engines free the GPU for the trainer (a no-op for any other runtime)."""
        for runtime in self.runtimes.built():
            if hasattr(runtime, "sleep"):
                await runtime.sleep()

    async def wake_engines(self) -> None:
        for runtime in self.runtimes.built():
            if hasattr(runtime, "wake_up"):
                await runtime.wake_up()

    async def after_training(self, step: int) -> None:
        """The engines take the GPU back; the policy's (if the run uses one) loads the weights of `step`."""
        await self.wake_engines()
        if self.uses_policy or self.runtimes.is_built(POLICY):
            await self.sync_policy(step + 1)

    async def sync_policy(self, step: int) -> None:
        """Make the policy runtime run the weights step `step` samples with: `weights/<v>` for the schedule's
        v = step - 1 - `[async] max_off_policy_steps` (0 and below: the base model).

        The first sync of a session always loads explicitly, and so does any sync after another
        run's session replaced the weights: an in-process engine is shared by every session of the
        process (`ModelRuntime.holds_its_weights`).
        """
        await self.load_policy(sampling_weights(step, self.config.async_.max_off_policy_steps))

    async def load_policy(self, wanted: int) -> None:
        """Make the policy runtime run `weights/<wanted>` (0: the base model), unless it already does."""
        from trace_rl.inference.broadcast import broadcast_weights
        from trace_rl.models.hub import resolve_model_path

        runtime = self.runtimes[POLICY]
        if self._policy_step == wanted and runtime.holds_its_weights:
            return
        if wanted == 0:
            await runtime.load_weights(resolve_model_path(self.config.model.name, self.config.model.revision), 0)
            runtime.policy_step = 0
        else:
            await broadcast_weights(runtime, self.storage, wanted)  # fails, naming the step, if not STABLE
        self._policy_step = wanted



# A `trace-rl serve` process runs every run started from the UI: it keeps the warm trainers of the
# most recently used runs only (an evicted run's trainer workers are stopped). An evicted run that steps again
# rebuilds its session from storage.
MAX_SESSIONS = 2
_SESSIONS: OrderedDict[str, Session] = OrderedDict()


def session_for(config: Config) -> Session:
    """The process's session for this run and config (one warm sampler and trainer per process)."""
    key = config_hash(config)  # of the whole config but what a step does not depend on: storage and name too
    if key in _SESSIONS:
        _SESSIONS.move_to_end(key)
    else:
        while len(_SESSIONS) >= MAX_SESSIONS:
            _, evicted = _SESSIONS.popitem(last=False)
            # its trainer workers hold processes (and GPU memory): stopped once the step they may be training ends
            threading.Thread(target=evicted.trainer.stop, name="release-trainer", daemon=True).start()
        _SESSIONS[key] = Session(config)
    return _SESSIONS[key]


def finish_checkpoint_writes() -> None:
    """Return once the checkpoints this process's trainers write in the background are written."""
    for session in list(_SESSIONS.values()):
        session.trainer.finish_checkpoint_write()
