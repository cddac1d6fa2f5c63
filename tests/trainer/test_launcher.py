"""Persistent torchrun trainer workers (2 gloo ranks): started once, kept across steps, restarted after a death."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from tests.bitwise import difference, weights_bytes
from tests.trainer.conftest import make_batch, storage_for
from trace_rl.machine import processes
from trace_rl.tables import write_batch
from trace_rl.trainer.lifecycle import train_one_step
from trace_rl.trainer.resume import TrainerError
from trace_rl.trainer.launcher import TrainerWorkers

pytestmark = pytest.mark.slow


def two_ranks(make_config, name: str, parallel: str):
    config = make_config(name, micro_batch_tokens=48, num_processes=2, parallel=parallel)
    store = storage_for(config)
    for step in (1, 2, 3):
        write_batch(store, step, make_batch(100 + step))
    return config, store


def test_the_same_workers_serve_steps_one_to_three_and_fresh_ones_resume_bitwise_after_a_sigkill(make_config):
    """FSDP2 with 2 gloo ranks: one launch serves steps 1 to 3 and stops cleanly; after a rank's SIGKILL in step 3,
    the resumed workers restore checkpoint 2 (sharding the full state dict) and train step 3 to the same bytes as
    the workers that never stopped."""
    config, store = two_ranks(make_config, "straight", "fsdp")
    with TrainerWorkers(config, store) as workers:
        served = []
        for step in (1, 2, 3):
            metrics = train_one_step(config, store, step, workers)
            assert metrics["samples"] == 8 and store.is_stable(store.path("weights", f"{step:06d}"))
            served.append(list(workers.pids))
        assert served[0] == served[1] == served[2] and len(set(served[0])) == 2
        assert set(served[0]) <= set(processes.descendants(workers.process.pid))  # torchrun's own ranks
        assert workers.step == 3
        launcher = workers.process
        # the private config and the logs, torchrun's own too, in a temp folder of this process's
        local = Path(workers.local)
        assert local.name.startswith(f"trace-rl-{os.getpid()}-workers-") and any((local / "torchrun").iterdir())
    assert launcher.poll() == 0  # a clean stop
    assert not local.exists()
    assert not any(processes.stat(pid) for pid in served[0])
    expected = weights_bytes(store, 3)

    config, store = two_ranks(make_config, "killed", "fsdp")
    with TrainerWorkers(config, store) as workers:
        for step in (1, 2):
            train_one_step(config, store, step, workers)
        first_pids = list(workers.pids)
        failure: list[BaseException] = []

        def step_three():
            try:
                train_one_step(config, store, 3, workers)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                failure.append(exc)

        thread = threading.Thread(target=step_three)
        thread.start()
        command = Path(workers.control) / "command-2.json"  # steps 1 and 2 were commands 0 and 1
        while not command.exists():
            time.sleep(0.001)
        os.kill(first_pids[1], signal.SIGKILL)
        thread.join(120)
        assert not thread.is_alive()
        assert len(failure) == 1 and isinstance(failure[0], TrainerError), failure
        assert "trainer workers died during step 3" in str(failure[0])
        assert not any(processes.stat(pid) for pid in first_pids)  # torchrun stopped rank 0 too
        assert not store.is_stable(store.path("weights", "000003"))
        assert store.latest_stable("checkpoints") == 2

        train_one_step(config, store, 3, workers)  # the retry: fresh workers restore checkpoint 2
        assert not set(workers.pids) & set(first_pids)
    assert (why := difference(weights_bytes(store, 3), expected)) is None, why


def test_fresh_workers_without_a_checkpoint_refuse_a_later_step(make_config):
    """Step 2 after a worker death with no checkpoint of step 1 (e.g. `ckpt.interval = 5`) must not train
    on the base model: only the first step may start from it."""
    config, store = two_ranks(make_config, "no-checkpoint", "ddp")
    with TrainerWorkers(config, store) as workers:
        refused = "step 2 trains on the state after step 1, but the latest checkpoint is none"
        with pytest.raises(TrainerError, match=refused):
            train_one_step(config, store, 2, workers)
        assert not store.is_stable(store.path("weights", "000002"))


def test_an_offloaded_worker_matches_one_process_and_restores_its_checkpoint_bitwise(make_config):
    """`trainer.cpu_offload` on one persistent worker: step 1 as one plain process computes it; shards and AdamW
    state restored from checkpoint 1 into CPU memory train step 2 to the same bytes as a worker that kept them."""
    single = make_config("single", micro_batch_tokens=48)
    single_store = storage_for(single)
    write_batch(single_store, 1, make_batch(101))
    expected = train_one_step(single, single_store, 1)
    stores = []
    for name in ("kept", "restored"):
        config = make_config(name, micro_batch_tokens=48, parallel="fsdp", cpu_offload=True)
        assert config.trainer.uses_workers
        store = storage_for(config)
        for step in (1, 2):
            write_batch(store, step, make_batch(100 + step))
        with TrainerWorkers(config, store) as workers:
            metrics = train_one_step(config, store, 1, workers)
            if name == "kept":
                assert abs(metrics["loss"] - expected["loss"]) <= 1e-6
                a, b = load(weights_bytes(single_store, 1)), load(weights_bytes(store, 1))
                assert a.keys() == b.keys()
                for key in a:
                    torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)
            if name == "restored":
                workers.stop()
            train_one_step(config, store, 2, workers)
        stores.append(store)
    assert (why := difference(weights_bytes(stores[0], 2), weights_bytes(stores[1], 2))) is None, why
    assert weights_bytes(stores[0], 1) != weights_bytes(stores[0], 2)
