"""`trace-rl train` and `trace-rl trainer-node` as a user or a launcher starts them on two nodes (loopback, gloo, one
rank each, the hf sampler): node 1 started before the run exists; both started together, node 1 SIGKILLed in step
2, then restarted with a fresh rendezvous port before `train --resume` on node 0, ending bitwise equal to the run
that lost no node.

The run that lost no node has the same topology, not `num_processes = 2` on one node: torchrun gives each rank one
thread when it starts several on a node and leaves the machine's default (2 here) when it starts one, and a
reduction split over two threads may round differently (tests/trainer/test_nodes.py compares nodes with one process
within float tolerance)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import tomli_w

from tests.bitwise import weights_difference
from tests.conftest import free_port
from tests.flows.conftest import small_config
from tests.flows.test_crash_resume import finish, output, start, train_here
from tests.trainer.test_nodes import finished, kill_node_one, start_node
from trace_rl.storage import RunStorage
from trace_rl.trainer.nodes import NODES, ControlDir, NodeSession
from trace_rl.trainer.launcher import stop_all

STEPS = 2  # node 1 is killed in the last one


def write_config(tmp_path: Path, file: str, name: str, **trainer) -> Path:
    path = tmp_path / f"{file}.toml"
    data = small_config(str(tmp_path / "runs"), name, steps=STEPS)
    data["trainer"].update(parallel="fsdp", **trainer)
    path.write_text(tomli_w.dumps(data))
    return path


def two_nodes(tmp_path: Path, file: str, name: str = "nodes") -> Path:
    """The two-node run's config, with a rendezvous port of its own."""
    return write_config(tmp_path, file, name, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}",
                        join_timeout_s=120, node_timeout_s=4)


def wait_until(ready, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.05)


@pytest.mark.slow
def test_nodes_started_together_and_a_node_restarted_before_resume_on_a_new_port_end_bitwise(prefect_api, tmp_path):
    reference, log = two_nodes(tmp_path, "reference", "reference"), tmp_path / "reference-node-1.log"
    node = start_node(reference, log)  # before node 0: the run does not exist yet
    wait_until(lambda: "waiting up to" in log.read_text(), "node 1's wait")
    train_here(reference)
    stop_all()  # the test process's workers stay for another run until stopped; then the session ends
    assert finished(node, log) == 0
    storage = RunStorage(str(tmp_path / "runs"), "nodes")

    first, log = two_nodes(tmp_path, "first"), tmp_path / "node-1.log"
    node, run = start_node(first, log), start(first)  # together

    def step_2_sent() -> ControlDir | None:
        session = NodeSession.current(storage)
        control_dir = session and ControlDir.in_storage(storage, NODES, session["id"])
        return control_dir if control_dir and control_dir.read("command-1.json") is not None else None

    wait_until(step_2_sent, "step 2's command")
    kill_node_one(step_2_sent(), node)
    assert run.wait(120) == 1
    failure = output(run)[output(run).rindex("\nerror: "):]
    print(failure)
    assert "during step 2" in failure and "node 1" in failure, failure
    assert "joining session" in log.read_text()
    assert not storage.is_stable(storage.path("weights", "000002"))

    again, log = two_nodes(tmp_path, "new-port"), tmp_path / "node-1-again.log"
    node = start_node(again, log)  # restarted first: the run's config.toml still holds the old port
    wait_until(lambda: "waiting up to" in log.read_text(), "node 1's wait")
    time.sleep(1.5)  # it read the old, ended session
    assert node.poll() is None, log.read_text()
    finish(start(again, "--resume"))
    assert finished(node, log) == 0
    assert log.read_text().count("joining session") == 1
    assert (why := weights_difference(storage, RunStorage(str(tmp_path / "runs"), "reference"), STEPS)) is None, why
