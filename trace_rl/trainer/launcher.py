"""Persistent torchrun trainer workers: started once per run, kept up across steps.

With `trainer.num_processes = N > 1`, or `trainer.cpu_offload` (N = 1 too), the run's process starts

    python -m torch.distributed.run --standalone --nnodes 1 --nproc_per_node N \\
        -m trace_rl.trainer.rank --control DIR --config FILE --parent PID:START

once. Every rank builds its model, restores the latest checkpoint and writes `ready-<rank>.json`;
then it waits for numbered commands in the private control directory `DIR`. Each step
(`TrainerWorkers.run_step`) writes `command-<n>.json` (the step; its batch is the step's
`steps/<step>/batch.parquet` in the run's storage) and waits until rank 0 writes
`result-<n>.json`, which it does after the step's weights (and checkpoint, when the step has one)
are STABLE. The model is never reloaded between steps.

With `trainer.nnodes = M > 1` this process is node 0: its torchrun joins the c10d rendezvous at
`trainer.rdzv_endpoint` (which it hosts) with the workers that `trace-rl trainer-node` starts on
nodes 1 .. M-1, and the control directory is the session's directory in the run's storage
(trace_rl/trainer/nodes.py), so every node reads the same commands. The first step fails, naming
the missing node ranks, when they have not all joined within `trainer.join_timeout_s`; a node
whose heartbeat stops for `trainer.node_timeout_s` fails the step in flight, naming it.

Every file is written to a temporary name and renamed, so a reader never sees half of one.
When a worker dies, torchrun stops the others and exits: the waiting step raises `TrainerError`
(retryable), and the next `train` starts fresh workers that restore the latest checkpoint. The
workers exit when their launcher is gone (they watch its pid and start time; the launching
process's reaper, `trace_rl.machine.reaper`, started before torchrun, also SIGKILLs them).
"""

from __future__ import annotations

import io
import os
import subprocess
import threading
import time
from typing import Any, Self

from trace_rl.config import Config
from trace_rl.errors import RefusedError
from trace_rl.machine import reaper, temp_folders
from trace_rl.storage import RunStorage, step_name
from trace_rl.trainer.nodes import (ControlDir, Heartbeat, NodeSession, NodeWatch, end_workers, heartbeat_interval,
                                    torchrun_command, write_private_config)
from trace_rl.trainer.resume import TrainerError, check_resumes_at

STOP_TIMEOUT_S = 60.0
LOG_TAIL = 4000

_RUNNING: set[TrainerWorkers] = set()


class TrainerWorkers:
    """The torchrun workers of one run (one per rank), kept up from the first step they train to `stop`: the one
    owner of their lifecycle. With several nodes, the other nodes' workers follow the session it starts."""

    def __init__(self, config: Config, storage: RunStorage):
        self.config = config
        self.storage = storage
        self.process: subprocess.Popen | None = None
        self.local: str | None = None  # private: the config with credentials, the workers' log
        self.control_dir: ControlDir | None = None
        self.session: NodeSession | None = None  # trainer.nnodes > 1
        self.watch: NodeWatch | None = None  # the other nodes' heartbeats
        self._heartbeat: Heartbeat | None = None
        self.pids: list[int] = []  # of this node's ranks, in rank order
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

    @property
    def control(self) -> str | None:
        """The control directory: a local path with one node, the session's directory in the run's storage with
        several."""
        return None if self.control_dir is None else self.control_dir.root

    @property
    def world_size(self) -> int:
        return self.config.trainer.num_processes * self.config.trainer.nnodes

    def start(self) -> None:
        """Launch the workers and wait until every rank (of every node) has restored the latest checkpoint."""
        self.local = temp_folders.make("workers")
        config_path = write_private_config(self.local, self.config)
        if self.config.trainer.nnodes > 1:
            self._open_session()
        else:
            self.control_dir = ControlDir.local(self.local)
        command = torchrun_command(self.config, self.control_dir.root, config_path, 0, self.session and self.session.id)
        reaper.start()
        with open(os.path.join(self.local, "workers.log"), "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _RUNNING.add(self)
        self._sent = 0
        deadline = None if self.session is None else time.monotonic() + self.config.trainer.join_timeout_s
        ready = [self._wait_for(f"ready-{rank}.json", "their start", deadline) for rank in range(self.world_size)]
        mine = [r for r in ready if r.get("node", 0) == 0]
        self.pids = [r["pid"] for r in mine]
        self._starts = [r["start"] for r in mine]
        self.step = ready[0]["restored"]

    def _open_session(self) -> None:
        """A new session in the run's storage (node 0's heartbeat first, then `nodes/session.json`)."""
        try:
            self.session = NodeSession.create(self.storage, self.config)
        except RefusedError as exc:
            raise TrainerError(str(exc)) from None
        self.control_dir = self.session.control_dir
        self._heartbeat = Heartbeat(self.control_dir, 0, heartbeat_interval(self.config)).start()
        self.session.publish()
        self.watch = self.session.watch(list(range(1, self.config.trainer.nnodes)), self.config)

    def run_step(self, step: int, extra_state: dict[str, Any] | None) -> dict[str, float]:
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
            try:
                self.start()
            except TrainerError:
                self.stop()
                raise
        check_resumes_at(self.step, step)
        n = self._sent
        self._sent += 1
        buffer = io.BytesIO()
        torch.save(dict(extra_state or {}), buffer)
        self.control_dir.write(f"extra-{n}.pt", buffer.getvalue())
        self.control_dir.write_json(f"command-{n}.json", {"step": step, "extra_state": f"extra-{n}.pt"})
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

    def _wait_for(self, name: str, what: str, deadline: float | None = None) -> Any:
        """The control file `name` once a worker wrote it; TrainerError when the workers die first, a node goes
        silent, or (joining) `deadline` passes."""
        while (found := self.control_dir.read_json(name)) is None:
            code = self.process.poll()
            if code is not None:
                raise TrainerError(f"trainer workers died during {what} (torchrun exit {code}); the next attempt "
                                   f"starts new workers from the latest checkpoint:\n{self._failure()}")
            if self.watch is not None:
                self._check_nodes(what, deadline)
            time.sleep(self.control_dir.poll_s)
        return found

    def _check_nodes(self, what: str, deadline: float | None) -> None:
        """TrainerError naming the nodes that went silent, or (past `deadline`) those that never joined."""
        gone = self.watch.gone()
        if gone:
            nodes = ", ".join(str(node) for node in gone)
            self._kill()
            raise TrainerError(f"trainer node {nodes} stopped answering during {what}; the next attempt starts new "
                               f"workers from the latest checkpoint (restart `trace-rl trainer-node` there if it "
                               f"died):\n{self._failure()}")
        if deadline is not None and time.monotonic() > deadline:
            missing = self.watch.missing() or list(self.watch.nodes)  # joined, but their workers are not ready
            nodes = ", ".join(str(node) for node in missing)
            self._kill()
            raise TrainerError(
                f"trainer node rank{'s' if len(missing) > 1 else ''} {nodes} did not join within "
                f"{self.config.trainer.join_timeout_s:g} s (trainer.join_timeout_s): run `trace-rl trainer-node "
                f"CONFIG --node-rank K` there with the same config (rendezvous {self.config.trainer.rdzv_endpoint}, "
                f"run {self.storage.url})")

    def _kill(self) -> None:
        """SIGKILL this node's torchrun (its ranks are killed by `stop`)."""
        if self.alive:
            self.process.kill()
            self.process.wait()

    def _failure(self) -> str:
        """The workers' own error reports if any wrote one, else the tail of their log; with several nodes, what
        became of each (`NodeSession.failure`)."""
        with open(os.path.join(self.local, "workers.log")) as f:
            log = f.read()[-LOG_TAIL:]
        if self.session is not None:
            return self.session.failure(self.watch, self.config, log)[-LOG_TAIL:]
        texts = []
        for name in self.control_dir.names("error-"):
            report = self.control_dir.read_json(name)
            texts.append(f"rank {name.removeprefix('error-').removesuffix('.json')}: {report['error']}")
        return "\n".join(texts)[-LOG_TAIL:] if texts else log

    def stop(self) -> None:
        """Ask the workers to exit (kill them if they do not within STOP_TIMEOUT_S) and remove the control dir.
        Called from another thread, it first waits for the step in flight."""
        with self._busy:
            self._stop()

    def _stop(self) -> None:
        if self.alive:
            self.control_dir.write_json(f"command-{self._sent}.json", {"stop": True})
        if self.process is not None:
            end_workers(self.process, list(zip(self.pids, self._starts)), STOP_TIMEOUT_S)
        if self.session is not None:
            self.session.end()  # the other nodes stop their workers
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.local is not None:
            temp_folders.remove(self.local)
        self.process, self.local, self.control_dir, self.pids, self._starts, self.step = None, None, None, [], [], None
        self.session, self.watch, self._heartbeat = None, None, None
        _RUNNING.discard(self)


def stop_all() -> None:
    """Stop every TrainerWorkers of this process (the CLI calls this before it exits)."""
    for workers in list(_RUNNING):
        workers.stop()
