"""The trainer across machines: how the torchrun workers of several nodes find each other and their steps.

With `[trainer] nnodes = M > 1` the training flow's machine is node 0: its `TrainerWorkers`
(trace_rl/trainer/launcher.py) owns the run's workers and sends them the steps. Every other node
runs `trace-rl trainer-node CONFIG --node-rank K` (`serve_node`), which starts that node's share
of the workers under the same c10d rendezvous. Nothing passes between the nodes but the
rendezvous (torch.distributed's own, at `trainer.rdzv_endpoint`) and small files under the run's
storage, each written to a temporary name and renamed into place (`ControlDir`), so a node on
another machine reads exactly what was written or nothing:

    <run>/nodes/session.json              the current session: id, config hash, nnodes, steps (+ "ended")
    <run>/nodes/<id>/node-<K>.json        node K's heartbeat (a counter, rewritten every few seconds)
    <run>/nodes/<id>/ready-<rank>.json    a rank restored the latest checkpoint (its node, host, pid)
    <run>/nodes/<id>/command-<n>.json     node 0's n-th command: a step (its extra state in extra-<n>.pt) or stop
    <run>/nodes/<id>/result-<n>.json      rank 0's metrics, once the step's weights are STABLE
    <run>/nodes/<id>/error-<rank>.json    a rank's traceback
    <run>/nodes/<id>/exit-<K>.json        node K's torchrun exit code

A session is one start of the workers (the first step, and again after a failure or a resume).
A trainer-node may start before node 0 (launchers start every node at once): it waits, polling
`nodes/session.json` every WAIT_POLL_S, for a live session of its own config hash, and it decides
against that session alone, never against the run's `config.toml`, which a `train --resume` with
a changed config (a fresh rendezvous port) is about to rewrite.
A node is gone when its heartbeat has not changed for `trainer.node_timeout_s` seconds of the
watcher's own clock (no clocks are compared across machines). With one node the same files live
in a private local directory and there is no session, heartbeat or rendezvous.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from trace_rl.config import Config, config_hash
from trace_rl.credentials import REVEAL
from trace_rl.errors import RefusedError
from trace_rl.machine import processes, reaper, temp_folders
from trace_rl.storage import RunStorage, first_unfinished_step

POLL_S = 0.02  # a local directory (one node) or a run on a local or shared file system
REMOTE_POLL_S = 0.25  # object storage: every poll is a request
END_GRACE_S = 10.0  # a node's workers may finish the stop command this long after node 0 ended the session
STOP_TIMEOUT_S = 30.0  # then torchrun gets this long to stop them before everything is SIGKILLed
WAIT_POLL_S = 1.0  # a trainer-node waiting for node 0's session reads nodes/session.json this often
RENDEZVOUS_GRACE_S = 60.0  # torchrun's rendezvous outlasts node 0's own join check (trainer.join_timeout_s) by this
NODES = "nodes"
SESSION = "session.json"


class ControlDir:
    """A directory of small files, each written whole by one process and polled by the others: on a local disk or
    under a run's storage (any fsspec filesystem). A reader sees a file complete or not at all."""

    def __init__(self, fs, root: str, poll_s: float):
        self.fs, self.root, self.poll_s = fs, root.rstrip("/"), poll_s

    @classmethod
    def local(cls, path: str) -> ControlDir:
        from fsspec.implementations.local import LocalFileSystem

        return cls(LocalFileSystem(), path, POLL_S)

    @classmethod
    def in_storage(cls, storage: RunStorage, *parts: str) -> ControlDir:
        poll_s = POLL_S if storage.protocol in ("file", "local") else REMOTE_POLL_S
        return cls(storage.fs, storage.path(*parts), poll_s)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def write(self, name: str, data: bytes) -> None:
        """Write to a temporary name, then rename (on S3 a copy, whose object appears only once complete)."""
        tmp = self.path(f".tmp-{uuid.uuid4().hex}-{name}")
        self.fs.makedirs(self.root, exist_ok=True)
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, self.path(name))

    def write_json(self, name: str, data: Any) -> None:
        self.write(name, json.dumps(data).encode())

    def read(self, name: str) -> bytes | None:
        """The file's bytes, or None if it is not there (read directly: no listing cache can hide a new file)."""
        try:
            return self.fs.cat_file(self.path(name))
        except FileNotFoundError:
            return None

    def read_json(self, name: str) -> Any | None:
        data = self.read(name)
        return None if data is None else json.loads(data)

    def names(self, prefix: str) -> list[str]:
        """The names of the complete files starting with `prefix`, sorted."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(name for entry in entries if (name := entry.rstrip("/").rsplit("/", 1)[-1]).startswith(prefix))


def worker_control_dir(config: Config, control: str) -> ControlDir:
    """The control directory a worker was given: in the run's storage with several nodes, else local."""
    if config.trainer.nnodes > 1:
        storage = RunStorage.of(config)
        return ControlDir(storage.fs, control, ControlDir.in_storage(storage).poll_s)
    return ControlDir.local(control)


def write_private_config(directory: str, config: Config) -> str:
    """The config with its real credentials, for this machine's workers only (`directory` is private, 0700)."""
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        f.write(config.model_dump_json(context={REVEAL: True}))
    return path


def torchrun_command(config: Config, control: str, config_path: str, node_rank: int = 0,
                     session: str | None = None) -> list[str]:
    """The torchrun command that starts this node's workers; its ranks watch this process (their launcher).
    torchrun's own logs go beside the private config, in the caller's temp folder (else torchrun leaves a folder
    of them in the temp dir at every start)."""
    trainer = config.trainer
    if trainer.nnodes == 1:
        rendezvous = ["--standalone", "--nnodes", "1"]
    else:
        conf = f"is_host={int(node_rank == 0)},join_timeout={int(rendezvous_timeout_s(config))}"  # ours fires first
        rendezvous = ["--nnodes", str(trainer.nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", trainer.rdzv_endpoint, "--rdzv-id", session, "--rdzv-conf", conf]
    me = processes.stat(os.getpid())
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node", str(trainer.num_processes),
            "--log-dir", os.path.join(os.path.dirname(config_path), "torchrun"),
            "-m", "trace_rl.trainer.rank", "--control", control, "--config", config_path,
            "--parent", f"{os.getpid()}:{me.start}", "--node-rank", str(node_rank)]


def rendezvous_timeout_s(config: Config) -> float:
    """How long torchrun's c10d rendezvous waits for every node (node 0's own join check fires before it)."""
    return config.trainer.join_timeout_s + RENDEZVOUS_GRACE_S


def end_workers(process: subprocess.Popen, ranks: list[tuple[int, int]], timeout: float) -> None:
    """Wait up to `timeout` s for torchrun to exit, SIGKILL it if it does not, then SIGKILL any of its ranks
    (pid, start) still running (they run in a session of their own)."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for pid, start in ranks:
        if processes.is_alive(pid, start):
            os.kill(pid, signal.SIGKILL)


# -- liveness ---------------------------------------------------------------------------------------
class Heartbeat:
    """A thread rewriting `node-<K>.json` in a session's control_dir every `interval` s, with a counter that watchers
    compare (not clocks); the first beat is written before `start` returns."""

    def __init__(self, control_dir: ControlDir, node_rank: int, interval: float):
        self.control_dir, self.node_rank, self.interval = control_dir, node_rank, interval
        self.beat = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-node-{node_rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._write()
        self._thread.start()
        return self

    def _write(self) -> None:
        self.beat += 1
        self.control_dir.write_json(f"node-{self.node_rank}.json", {"beat": self.beat, "host": socket.gethostname(),
                                                               "pid": os.getpid()})

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self._write()
            except Exception:  # noqa: BLE001 - a storage hiccup: the next beat may pass (watchers allow several)
                pass

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class NodeWatch:
    """Which nodes stopped beating: a node whose heartbeat has not changed for `timeout` s of this machine's
    clock is gone. Nodes that never wrote one are not watched (see `missing`). Reads at most every `every` s."""

    def __init__(self, control_dir: ControlDir, nodes: list[int], timeout: float, every: float):
        self.control_dir, self.nodes, self.timeout, self.every = control_dir, nodes, timeout, every
        self.seen: dict[int, tuple[int, float]] = {}  # node -> (beat, when this watcher first saw it)
        self.beating: set[int] = set()  # the nodes whose heartbeat changed while watched: alive, not left over
        self._read_at = -float("inf")

    def look(self) -> None:
        """Read the heartbeats (unless that was done less than `every` s ago)."""
        now = time.monotonic()
        if now - self._read_at < self.every:
            return
        self._read_at = now
        for node in self.nodes:
            try:
                beat = (self.control_dir.read_json(f"node-{node}.json") or {}).get("beat")
            except (OSError, ValueError):  # unreadable this time: as if unchanged
                continue
            if beat is not None and (node not in self.seen or self.seen[node][0] != beat):
                if node in self.seen:
                    self.beating.add(node)
                self.seen[node] = (beat, now)

    def gone(self) -> dict[int, float]:
        """Node -> seconds without a new heartbeat, for the nodes silent longer than `timeout`."""
        self.look()
        now = time.monotonic()
        return {node: now - at for node, (_, at) in sorted(self.seen.items()) if now - at > self.timeout}

    def missing(self) -> list[int]:
        """The nodes that never wrote a heartbeat (never joined)."""
        self.look()
        return [node for node in self.nodes if node not in self.seen]


def heartbeat_interval(config: Config) -> float:
    """How often a node beats (and watchers look): five beats per `trainer.node_timeout_s`."""
    return max(0.2, config.trainer.node_timeout_s / 5)


# -- sessions ---------------------------------------------------------------------------------------
def check_shared(storage: RunStorage) -> None:
    """A RefusedError for a storage the other nodes cannot reach."""
    if storage.protocol == "memory":
        raise RefusedError("trainer.nnodes > 1 needs a storage every node reaches (a shared path or s3://), "
                           "not memory://")


class NodeSession:
    """One start of a multi-node run's workers: `nodes/session.json` names it, `nodes/<id>/` is its control_dir."""

    def __init__(self, storage: RunStorage, info: dict[str, Any]):
        self.storage, self.info, self.id = storage, info, info["id"]
        self.nodes = ControlDir.in_storage(storage, NODES)
        self.control_dir = ControlDir.in_storage(storage, NODES, self.id)

    @classmethod
    def create(cls, storage: RunStorage, config: Config) -> NodeSession:
        """Node 0's new session (published by `publish`); earlier sessions' files are removed."""
        check_shared(storage)
        for name in ControlDir.in_storage(storage, NODES).names(""):
            if name != SESSION:
                storage.remove(storage.path(NODES, name))
        info = {"id": uuid.uuid4().hex[:12], "config_hash": config_hash(config), "nnodes": config.trainer.nnodes,
                "steps": config.steps, "rdzv_endpoint": config.trainer.rdzv_endpoint}
        return cls(storage, info)

    @classmethod
    def current(cls, storage: RunStorage) -> dict[str, Any] | None:
        """What `nodes/session.json` says now (None before a first session)."""
        return ControlDir.in_storage(storage, NODES).read_json(SESSION)

    def publish(self) -> None:
        self.nodes.write_json(SESSION, self.info)

    def end(self) -> None:
        """Mark the session ended (the other nodes stop their workers), unless a newer one replaced it."""
        now = self.current(self.storage)
        if now is not None and now["id"] == self.id and not now.get("ended"):
            self.nodes.write_json(SESSION, {**self.info, "ended": True})

    def is_over(self) -> bool:
        now = self.current(self.storage)
        return now is None or now["id"] != self.id or bool(now.get("ended"))

    def watch(self, nodes: list[int], config: Config) -> NodeWatch:
        return NodeWatch(self.control_dir, nodes, config.trainer.node_timeout_s, heartbeat_interval(config))

    def errors(self) -> list[str]:
        """Each rank's error report, as `node K rank R: <the traceback's end>`."""
        lines = []
        for name in self.control_dir.names("error-"):
            report = self.control_dir.read_json(name) or {}
            rank = name.removeprefix("error-").removesuffix(".json")
            lines.append(f"node {report.get('node', '?')} rank {rank}: {report.get('error', '')[-1500:].strip()}")
        return lines

    def failure(self, watch: NodeWatch, config: Config, own: str) -> str:
        """Why the session failed, naming the nodes: ends the session, then waits (at most node_timeout_s) until
        every other node either reported its workers' exit or went silent. `own` is node 0's own report."""
        self.end()
        remote = watch.nodes
        deadline = time.monotonic() + config.trainer.node_timeout_s + watch.every
        while time.monotonic() < deadline:
            exited = {node for node in remote if self.control_dir.read(f"exit-{node}.json") is not None}
            if set(remote) <= exited | set(watch.gone()) | set(watch.missing()):
                break
            time.sleep(watch.every)
        lines = [f"node {node} is gone: no heartbeat for {silent:.0f} s (trainer.node_timeout_s = "
                 f"{config.trainer.node_timeout_s:g})" for node, silent in watch.gone().items()]
        lines += [f"node {node} never joined" for node in watch.missing()]
        lines += self.errors() or [f"node 0: {own}"]
        return "\n".join(lines)


# -- the other nodes: `trace-rl trainer-node` ------------------------------------------------------------
def check_node(config: Config, node_rank: int) -> RunStorage:
    """The run's storage if node `node_rank` may serve it; else a RefusedError in one line: a single-node config,
    a node rank out of range or a storage only this machine sees. The run itself may not exist yet (`next_session`
    waits for it)."""
    nnodes = config.trainer.nnodes
    if nnodes == 1:
        raise RefusedError("trainer.nnodes = 1: this run has no other trainer nodes; set [trainer] nnodes and "
                           "rdzv_endpoint in the config that both `trace-rl train` and `trace-rl trainer-node` use")
    if not 1 <= node_rank < nnodes:
        raise RefusedError(f"--node-rank {node_rank}: must be 1 to {nnodes - 1} (trainer.nnodes = {nnodes}; node 0 "
                           "is the machine that runs `trace-rl train`)")
    storage = RunStorage.of(config)
    check_shared(storage)
    return storage


def serve_node(config: Config, node_rank: int, wait_s: float | None = None,
               say: Callable[[str], None] = lambda line: None) -> None:
    """Serve node `node_rank` of the run: join each new session with this node's workers, until the run has
    trained its last step. Each wait for node 0's next session lasts at most `wait_s` s (default: the rendezvous
    timeout, `rendezvous_timeout_s`). A session this node already joined (before a restart of this process) is
    skipped."""
    storage = check_node(config, node_rank)
    wait_s = rendezvous_timeout_s(config) if wait_s is None else wait_s
    private = temp_folders.make("node")
    config_path = write_private_config(private, config)
    try:
        while True:
            say(f"node {node_rank}: waiting up to {wait_s:g} s for node 0 to start a session of the run at "
                f"{storage.url} (config hash {config_hash(config)})")
            session = next_session(storage, config, node_rank, wait_s)
            say(f"node {node_rank}: joining session {session.id} (rendezvous {config.trainer.rdzv_endpoint})")
            code = run_session(session, config, node_rank, config_path)
            say(f"node {node_rank}: session {session.id} ended (torchrun exit {code})")
            if first_unfinished_step(storage) > session.info["steps"]:
                say(f"node {node_rank}: the run has trained all {session.info['steps']} steps")
                return
    finally:
        temp_folders.remove(private)


def next_session(storage: RunStorage, config: Config, node_rank: int, wait_s: float) -> NodeSession:
    """The session this node joins next: one that has not ended, has this config's hash and that this node has
    not joined yet; waits up to `wait_s` s for it (the run may not exist yet). A session with another config
    hash is refused (RefusedError) as soon as node 0's heartbeat in it moves: it is live. One whose heartbeat
    stands still was left by a node 0 that died, and is waited past, as is an ended one. After `wait_s`, a
    RefusedError names what was waited for."""
    nodes = ControlDir.in_storage(storage, NODES)
    ours = config_hash(config)
    deadline = time.monotonic() + wait_s
    watches: dict[str, NodeWatch] = {}  # node 0's heartbeat in each session with another config
    while True:
        info = nodes.read_json(SESSION)
        if info is not None and not info.get("ended"):
            session = NodeSession(storage, info)
            if info["config_hash"] == ours:
                if session.control_dir.read(f"node-{node_rank}.json") is None:
                    return session
            else:
                watch = watches.setdefault(session.id, NodeWatch(session.control_dir, [0], config.trainer.node_timeout_s,
                                                                  every=0.0))
                watch.look()
                if watch.beating:
                    raise RefusedError(
                        f"node 0 runs a session of the run at {storage.url} with another config (config hash "
                        f"{info['config_hash']}, this node's {ours}): start this node with the same CONFIG and --set "
                        "overrides as `trace-rl train`")
        if time.monotonic() >= deadline:
            raise RefusedError(f"waited {wait_s:g} s for node 0 to start a session of the run at {storage.url} with "
                               f"this node's config (hash {ours}): {not_yet(storage, info, ours)}; start "
                               "`trace-rl train` on node 0 with the same config, or wait longer (--wait-s)")
        time.sleep(WAIT_POLL_S)


def not_yet(storage: RunStorage, info: dict[str, Any] | None, ours: str) -> str:
    """What `nodes/session.json` showed last, for a node that waited in vain."""
    if info is None:
        if not storage.exists(storage.path("config.toml")):
            return "there is no run (no config.toml)"
        return "node 0 has not started a session (no nodes/session.json)"
    if info.get("ended"):
        return f"its last session {info['id']} has ended"
    if info["config_hash"] != ours:
        return (f"its session {info['id']} has config hash {info['config_hash']} and no heartbeat of node 0: left "
                "by an earlier start")
    return f"this node already served its session {info['id']}"


def run_session(session: NodeSession, config: Config, node_rank: int, config_path: str) -> int:
    """Run this node's workers in `session` until they exit, the session ends (they get END_GRACE_S to finish)
    or node 0 goes silent; report the exit code in `exit-<K>.json` and return it."""
    heartbeat = Heartbeat(session.control_dir, node_rank, heartbeat_interval(config)).start()
    reaper.start()
    process = subprocess.Popen(torchrun_command(config, session.control_dir.root, config_path, node_rank, session.id),
                               stdin=subprocess.DEVNULL)
    watch = session.watch([0], config)
    ended_at = None
    try:
        while process.poll() is None:
            time.sleep(watch.every)
            if ended_at is None and (session.is_over() or watch.gone()):
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > END_GRACE_S:
                process.terminate()  # torchrun stops its workers
                break
        end_workers(process, own_ranks(session, node_rank), STOP_TIMEOUT_S)
        session.control_dir.write_json(f"exit-{node_rank}.json", {"code": process.returncode})
    finally:
        heartbeat.stop()
    return process.returncode



def own_ranks(session: NodeSession, node_rank: int) -> list[tuple[int, int]]:
    """(pid, start) of this node's ranks, from their ready files."""
    ranks = []
    for name in session.control_dir.names("ready-"):
        ready = session.control_dir.read_json(name) or {}
        if ready.get("node") == node_rank:
            ranks.append((ready["pid"], ready["start"]))
    return ranks
