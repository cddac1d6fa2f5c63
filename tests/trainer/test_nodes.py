"""The trainer on two nodes over loopback (gloo, one process each): node 0 is this test's `TrainerWorkers`, node 1
a `trace-rl trainer-node` process; their control files travel through the run's storage (the tests' S3 server, and
a local path)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tomli_w
from safetensors.torch import load

from tests.conftest import free_port
from tests.trainer.conftest import make_batch, storage_for
from trace_rl.config import Config, config_to_toml
from trace_rl.machine import temp_folders
from trace_rl.tables import write_batch
from trace_rl.trainer.launcher import TrainerWorkers
from trace_rl.trainer.lifecycle import train_one_step
from trace_rl.trainer.nodes import ControlDir, Heartbeat, NodeSession, heartbeat_interval
from trace_rl.trainer.resume import TrainerError

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
NODE_TIMEOUT_S = 4.0
ENV = [{"id": "reverse-text"}]  # node 1 loads the config as `trace-rl` does: a real env (the batches are synthetic)


def with_batches(config: Config):
    store = storage_for(config)
    for step in range(1, STEPS + 1):
        write_batch(store, step, make_batch(100 + step))
    return store


def weights(store, step: int) -> dict:
    return load(store.read_bytes(store.path("weights", f"{step:06d}", "model.safetensors")))


def one_process_weights(make_config) -> dict:
    config = make_config("one", micro_batch_tokens=48)
    store = with_batches(config)
    for step in range(1, STEPS + 1):
        train_one_step(config, store, step)
    return weights(store, STEPS)


@pytest.fixture
def two_nodes(make_config, tmp_path, s3_server):
    """`build(name)`: a two-node config (its run's config.toml written, as `trace-rl train` does, and its batches)
    on the tests' S3 server, its storage, and the config file node 1 is started with. Two nodes on a local path,
    killed and resumed the same way: tests/flows/test_trainer_nodes.py, through `trace-rl train`."""

    def build(name: str, **trainer):
        config = make_config(name, micro_batch_tokens=48, parallel="fsdp", nnodes=2,
                             rdzv_endpoint=f"127.0.0.1:{free_port()}", join_timeout_s=120,
                             node_timeout_s=NODE_TIMEOUT_S, **trainer)
        update = {"steps": STEPS, "env": ENV, "storage": f"s3://{s3_server['bucket']}/{tmp_path.name}",
                  "storage_options": s3_server["storage_options"]}
        config = Config.model_validate({**config.model_dump(), **update})
        store = with_batches(config)
        store.write_atomic(store.path("config.toml"), config_to_toml(config).encode())
        path = tmp_path / f"{name}.toml"
        path.write_text(config_to_toml(config))  # credentials stay out: node 1 reads them from the environment
        return config, store, path

    return build


def start_node(path: Path, log: Path, *extra: str) -> subprocess.Popen:
    """`trace-rl trainer-node PATH --node-rank 1` in a process group of its own."""
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "trainer-node", str(path), "--node-rank", "1",
                                 *extra], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, process_group=0)


def finished(node: subprocess.Popen, log: Path) -> int:
    try:
        return node.wait(120)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        print(log.read_text()[-3000:])


@pytest.mark.slow
def test_two_nodes_train_like_one_process_and_resume_bitwise_after_node_one_dies(make_config, two_nodes, tmp_path):
    expected = one_process_weights(make_config)

    config, store, path = two_nodes("straight")
    node = start_node(path, tmp_path / "straight.log")
    with TrainerWorkers(config, store) as workers:
        for step in range(1, STEPS + 1):
            assert train_one_step(config, store, step, workers)["samples"] == 8
        assert len(workers.pids) == 1  # node 0's own rank
    assert finished(node, tmp_path / "straight.log") == 0  # the run has trained its last step: node 1 is done
    straight = weights(store, STEPS)
    for name in expected:
        assert (straight[name] - expected[name]).abs().max().item() <= 1e-5, name  # all-reduce vs one sum: float noise

    config, store, path = two_nodes("killed")
    log = tmp_path / "killed.log"
    node = start_node(path, log)
    with TrainerWorkers(config, store) as workers:
        train_one_step(config, store, 1, workers)
        failure: list[BaseException] = []
        thread = threading.Thread(target=lambda: capture(failure, train_one_step, config, store, 2, workers))
        thread.start()
        while workers.control_dir.read("command-1.json") is None:  # step 2 was sent
            time.sleep(0.01)
        kill_node_one(workers.control_dir, node)
        killed = time.monotonic()
        thread.join(180)
        assert not thread.is_alive()
        assert len(failure) == 1 and isinstance(failure[0], TrainerError), failure
        print(failure[0])
        assert "step 2" in str(failure[0]) and "node 1" in str(failure[0]), failure[0]
        assert time.monotonic() - killed < 60
        assert not store.is_stable(store.path("weights", "000002"))
        assert store.latest_stable("checkpoints") == 1

        node = start_node(path, log)  # node 1 restarted; the retry starts a new session from checkpoint 1
        for step in (2, 3):
            train_one_step(config, store, step, workers)
    assert finished(node, log) == 0
    resumed = weights(store, STEPS)
    assert all((resumed[name] == straight[name]).all() for name in straight)


def capture(failures: list, function, *args) -> None:
    try:
        function(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        failures.append(exc)


def kill_node_one(control_dir: ControlDir, node: subprocess.Popen) -> None:
    """What a lost machine looks like: node 1's trainer-node, its torchrun and its rank (in a session of its own,
    found in the session's `control_dir`) all SIGKILLed at once."""
    ranks = [control_dir.read_json(name) for name in control_dir.names("ready-")]
    os.killpg(node.pid, signal.SIGKILL)
    for ready in ranks:
        if ready["node"] == 1:
            os.kill(ready["pid"], signal.SIGKILL)
    node.wait()
    for folder in temp_folders.left_by(node.pid):  # its reaper died with it; a lost machine's disk goes with it too
        temp_folders.remove(folder)


@pytest.mark.slow
def test_a_node_that_never_joins_fails_the_first_step_naming_it(make_config, tmp_path):
    config = make_config("alone", micro_batch_tokens=48, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                         join_timeout_s=5)
    store = with_batches(config)
    start = time.monotonic()
    with TrainerWorkers(config, store) as workers:
        with pytest.raises(TrainerError, match="trainer node rank 1 did not join within 5 s"):
            train_one_step(config, store, 1, workers)
        assert not workers.alive
    assert time.monotonic() - start < 60
    assert NodeSession.current(store)["ended"]


def node_main(capsys, path: Path, *flags: str) -> tuple[int, str, float]:
    """`trace-rl trainer-node PATH --node-rank 1 FLAGS` in this process: its exit code, its error line (after the
    node's progress lines) and how long it took."""
    from flows.cli import main

    start = time.monotonic()
    code = main(["trainer-node", str(path), "--node-rank", "1", *flags])
    *progress, err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("node 1: waiting up to") for line in progress), progress
    return code, err, time.monotonic() - start


def test_trainer_node_waits_for_a_live_session_of_its_config_and_refuses_another_in_one_line(make_config, tmp_path,
                                                                                           capsys):
    """What node 1 decides before it starts any worker, by what nodes/session.json holds: it waits (here briefly)
    for the run, past ended sessions and sessions node 0 left behind when it died, for one of its own config; a
    live session of another config is refused as soon as node 0's heartbeat in it moves."""
    config = make_config("nodes", nnodes=2, rdzv_endpoint="127.0.0.1:29555", node_timeout_s=1.0)
    config = Config.model_validate({**config.model_dump(), "env": ENV})
    path = tmp_path / "nodes.toml"
    path.write_text(config_to_toml(config))
    store = storage_for(config)
    other = ("--set", "trainer.lr=0.5")

    code, err, took = node_main(capsys, path, "--wait-s", "0.5")
    assert code == 2 and "waited 0.5 s for node 0 to start a session" in err and "no config.toml" in err, err
    assert 0.5 <= took < 5

    store.write_atomic(store.path("config.toml"), config_to_toml(config).encode())
    left_behind = NodeSession.create(store, config)  # node 0 died in it: one heartbeat, never ended
    Heartbeat(left_behind.control_dir, 0, 60).start().stop()
    left_behind.publish()
    code, err, took = node_main(capsys, path, *other, "--wait-s", "1")
    assert code == 2 and f"its session {left_behind.id} has config hash" in err and "left by an earlier" in err, err
    assert took >= 1

    live = NodeSession.create(store, config)
    heartbeat = Heartbeat(live.control_dir, 0, heartbeat_interval(config)).start()
    live.publish()
    try:
        code, err, took = node_main(capsys, path, *other, "--wait-s", "60")
        assert code == 2 and "node 0 runs a session" in err and "with another config (config hash" in err, err
        assert took < 10
    finally:
        heartbeat.stop()
    live.end()
    code, err, _ = node_main(capsys, path, "--wait-s", "1")
    assert code == 2 and f"its last session {live.id} has ended" in err, err

    assert node_main(capsys, path, "--wait-s", "-1")[:2] == (2, "error: --wait-s -1: must be 0 or more (seconds to "
                                                                 "wait for node 0's session)")
    code, err, _ = node_main(capsys, path, "--node-rank", "2")
    assert code == 2 and "must be 1 to 1" in err
    data = {**config.model_dump(mode="json", exclude_none=True), "trainer": {"nnodes": 2}}
    path.write_text(tomli_w.dumps(data))
    from flows.cli import main

    assert main(["trainer-node", str(path), "--node-rank", "1"]) == 2
    assert "rdzv_endpoint" in capsys.readouterr().err
