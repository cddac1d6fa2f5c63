"""Stage timers: wall seconds spent inside named library functions, installed by patching them in place.

The pipeline's stages (`trace_rl.pipeline.step.*`), its Parquet reads and writes and the trainer's
compute, checkpoint and export are wrapped so that the Prefect flow (whose tasks call
`trace_rl.pipeline.step.<stage>` by module attribute) and `trace_rl.pipeline.step.run_step` (which calls
the module globals) are timed by the same clocks. Only bench code installs them.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import defaultdict
from contextlib import contextmanager

STAGE_FUNCTIONS = ("sample_rollouts", "run_algorithm", "validate_dimensions", "aggregate_channels", "write_batch",
                   "train", "broadcast_weights")
# (module, attribute, label): Parquet I/O as trace_rl.pipeline.step and the trainer call it, and the trainer's parts
STORAGE_FUNCTIONS = (
    ("trace_rl.pipeline.step", "write_traces", "io/write_traces"),
    ("trace_rl.pipeline.step", "read_traces", "io/read_traces"),
    ("trace_rl.pipeline.step", "write_channels", "io/write_channels"),
    ("trace_rl.pipeline.step", "read_channels", "io/read_channels"),
    ("trace_rl.pipeline.step", "write_samples", "io/write_aggregated"),
    ("trace_rl.pipeline.step", "read_samples", "io/read_aggregated"),
    ("trace_rl.pipeline.step", "write_batch_table", "io/write_batch"),
    ("trace_rl.trainer.lifecycle", "read_batch", "io/read_batch"),
)
TRAINER_METHODS = (("optimizer_step", "trainer/compute"), ("save_checkpoint", "trainer/checkpoint"),
                   ("export_weights", "trainer/export_weights"))


class Timers:
    """Accumulated seconds per label since the last `take()`."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._patched: list[tuple[object, str, object]] = []

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken

    def _wrap(self, fn, label_of):
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed_async(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self.seconds[label_of(args, kwargs)] += time.perf_counter() - started
            return timed_async

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label_of(args, kwargs)] += time.perf_counter() - started
        return timed

    def patch(self, owner, name: str, label_of) -> None:
        original = getattr(owner, name)
        self._patched.append((owner, name, original))
        setattr(owner, name, self._wrap(original, label_of))

    def restore(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()


def stage_label(name: str):
    if name != "run_algorithm":
        return lambda args, kwargs: name
    return lambda args, kwargs: f"algorithm/{(kwargs.get('job') or args[2]).config.id}"


@contextmanager
def pipeline_timers():
    """Time every stage, every Parquet read/write and the trainer's parts while the block runs."""
    import importlib

    from trace_rl.pipeline import step
    from trace_rl.trainer.trainer import Trainer

    timers = Timers()
    for name in STAGE_FUNCTIONS:
        timers.patch(step, name, stage_label(name))
    for module, name, label in STORAGE_FUNCTIONS:
        timers.patch(importlib.import_module(module), name, lambda args, kwargs, label=label: label)
    for name, label in TRAINER_METHODS:
        timers.patch(Trainer, name, lambda args, kwargs, label=label: label)
    try:
        yield timers
    finally:
        timers.restore()
