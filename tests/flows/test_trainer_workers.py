"""The train flow with `trainer.num_processes = 2`: the run's persistent workers train every step."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.flows.conftest import small_config
from trace_rl.machine import processes
from trace_rl.pipeline.session import session_for
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage
from trace_rl.trainer.launcher import stop_all


@pytest.mark.slow
def test_a_run_on_two_gloo_workers_matches_one_process(prefect_api, tmp_path):
    from flows.train import run_training

    def run(name: str, **trainer):
        config = validate_config(small_config(str(tmp_path), name, steps=3, ckpt={"interval": 2},
                                              trainer={"lr": 1e-3, "micro_batch_tokens": 1024, **trainer}))
        run_training(config)
        storage = RunStorage(config.storage, config.name)
        return config, load_file(f"{storage.path('weights', '000003')}/model.safetensors")

    _, expected = run("one")
    config, weights = run("two", num_processes=2, parallel="fsdp")
    for name in expected:
        assert (weights[name] - expected[name]).abs().max().item() <= 1e-6, name
    workers = session_for(config).trainer.at(4)
    assert workers.alive and workers.step == 3 and len(workers.pids) == 2
    pids = list(workers.pids)
    stop_all()  # what the CLI's quiet.stop_engines() does for workers (it would also stop the session's vLLM engine)
    assert not workers.alive and not any(processes.stat(pid) for pid in pids)
