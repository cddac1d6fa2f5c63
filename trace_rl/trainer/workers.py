"""Persistent torchrun trainer workers: started once per run, kept up across steps.

With `trainer.num_processes = N > 1`, or `trainer.cpu_offload` (N = 1 too), the run's process starts

    python -m torch.distributed.run --standalone --nnodes 1 --nproc_per_node N \\
        -m trace_rl.trainer.worker --control DIR --parent PID:START

once. Every rank builds its model, restores the latest checkpoint and writes `ready-<rank>.json`;
then it waits for numbered commands in the private control directory `DIR`. Each step
(`TrainerWorkers.train`) writes `command-<n>.json` (the step; its batch is the step's
`steps/<step>/batch.parquet` in the run's storage) and waits until rank 0 writes
`result-<n>.json`, which it does after the step's weights (and checkpoint, when the step has one)
are STABLE. The model is never reloaded between steps.

Every file is written to a temporary name and renamed, so a reader never sees half of one.
When a worker dies, torchrun stops the others and exits: the waiting step raises `TrainerError`
(retryable), and the next `train` starts fresh workers that restore the latest checkpoint. The
workers exit when their launcher is gone (they watch its pid and start time; the CLI's reaper
also SIGKILLs them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Self

from trace_rl import processes
from trace_rl.config import Config
from trace_rl.credentials import REVEAL
from trace_rl.storage import RunStorage, step_name
from trace_rl.trainer.run import TrainerError, check_resumes_at

POLL_S = 0.02
STOP_TIMEOUT_S = 60.0
LOG_TAIL = 4000

_RUNNING: set[TrainerWorkers] = set()


def write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class TrainerWorkers:
    """The torchrun workers of one run (one per local rank), kept up from the first step they train to `stop`."""

    def __init__(self, config: Config, storage: RunStorage):
        self.config = config
        self.storage = storage
        self.process: subprocess.Popen | None = None
        self.control: str | None = None
        self.pids: list[int] = []  # of the ranks, in rank order
        self.step: int | None = None  # the last step whose optimizer step the workers hold
        self._starts: list[int] = []
        self._sent = 0
        self._busy = threading.RLock()  # a `stop` from another thread waits for the step in flight

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Launch the workers and wait until every rank has restored the latest checkpoint."""
        self.control = tempfile.mkdtemp(prefix="trace-rl-workers-")
        with open(os.path.join(self.control, "config.json"), "w") as f:  # private (0700): real credentials
            f.write(self.config.model_dump_json(context={REVEAL: True}))
        me = processes.stat(os.getpid())
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(self.config.trainer.num_processes),
            "-m", "trace_rl.trainer.worker", "--control", self.control, "--parent", f"{os.getpid()}:{me.start}",
        ]
        with open(os.path.join(self.control, "workers.log"), "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _RUNNING.add(self)
        self._sent = 0
        ready = [self._wait_for(f"ready-{rank}.json", "their start") for rank in range(self.config.trainer.num_processes)]
        self.pids = [r["pid"] for r in ready]
        self._starts = [r["start"] for r in ready]
        self.step = ready[0]["restored"]

    def train(self, step: int, extra_state: dict[str, Any] | None) -> dict[str, float]:
        """Train `step` on the workers (starting them if needed); returns rank 0's metrics once its weights
        (and its checkpoint, if `ckpt.interval` gives it one) are STABLE."""
        with self._busy:
            return self._train(step, extra_state)

    def _train(self, step: int, extra_state: dict[str, Any] | None) -> dict[str, float]:
        import torch

        if self.alive and self.step is not None and self.step != step - 1:
            self.stop()  # they hold another step's state (a re-run after a resume): restore from storage
        if not self.alive:
            self.stop()
            self.start()
        check_resumes_at(self.step, step)
        first_step = self.step is None and step <= 1  # no checkpoint: only the first step starts from the base model
        if not first_step and self.step != step - 1:
            raise TrainerError(
                f"step {step} trains on the state after step {step - 1}, but the latest checkpoint is "
                f"{'none' if self.step is None else 'of step ' + str(self.step)}; resume the run (it re-runs the "
                "steps after its newest checkpoint)")
        n = self._sent
        self._sent += 1
        extra_path = os.path.join(self.control, f"extra-{n}.pt")
        torch.save(dict(extra_state or {}), extra_path)
        write_json_atomic(os.path.join(self.control, f"command-{n}.json"), {"step": step, "extra_state": extra_path})
        try:
            metrics = self._wait_for(f"result-{n}.json", f"step {step}")
        except TrainerError:
            self.stop()
            raise
        weights = self.storage.path("weights", step_name(step))
        if not self.storage.is_stable(weights):  # rank 0 writes its result after the STABLE markers
            raise TrainerError(f"trainer workers reported step {step} done, but {weights} is not STABLE")
        self.step = step
        return metrics

    def _wait_for(self, name: str, what: str) -> Any:
        path = os.path.join(self.control, name)
        while not os.path.exists(path):
            code = self.process.poll()
            if code is not None:
                raise TrainerError(f"trainer workers died during {what} (torchrun exit {code}); the next attempt "
                                   f"starts new workers from the latest checkpoint:\n{self._failure()}")
            time.sleep(POLL_S)
        with open(path) as f:
            return json.load(f)

    def _failure(self) -> str:
        """The workers' own error reports if any wrote one, else the tail of their log."""
        errors = sorted(name for name in os.listdir(self.control) if name.startswith("error-"))
        texts = []
        for name in errors:
            with open(os.path.join(self.control, name)) as f:
                texts.append(f"rank {name.removeprefix('error-').removesuffix('.json')}: {json.load(f)}")
        if texts:
            return "\n".join(texts)[-LOG_TAIL:]
        with open(os.path.join(self.control, "workers.log")) as f:
            return f.read()[-LOG_TAIL:]

    def stop(self) -> None:
        """Ask the workers to exit (kill them if they do not within STOP_TIMEOUT_S) and remove the control dir.
        Called from another thread, it first waits for the step in flight."""
        with self._busy:
            self._stop()

    def _stop(self) -> None:
        if self.alive:
            write_json_atomic(os.path.join(self.control, f"command-{self._sent}.json"), {"stop": True})
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid, start in zip(self.pids, self._starts):  # a rank torchrun could not stop
            if processes.is_alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        if self.control is not None:
            shutil.rmtree(self.control, ignore_errors=True)
        self.process, self.control, self.pids, self._starts, self.step = None, None, [], [], None
        _RUNNING.discard(self)


def stop_all() -> None:
    """Stop every TrainerWorkers of this process (the CLI calls this before it exits)."""
    for workers in list(_RUNNING):
        workers.stop()
