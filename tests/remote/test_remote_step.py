"""Training steps whose algorithm runs on a real env server: its values land in the batch exactly, and a run
whose server is down is refused before step 1, then runs once the server is up."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import free_port
from tests.flows.conftest import small_config
from tests.flows.test_pipeline import step_runs
from tests.remote.conftest import TOKEN_ENV, env_server
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage
from trace_rl.tables import read_batch, read_traces

SCALE = 0.1
STAGES = ["sample_rollouts", "position_signal", "validate_dimensions", "aggregate_channels", "write_batch", "train",
          "broadcast_weights"]


def remote_config(storage: str, name: str, server: str, steps: int = 1, **overrides):
    return validate_config(small_config(
        storage, name, steps=steps,
        env=[{"id": "reverse-text", "batch_size": 2, "group_size": 4, "server": server,
              "algorithms": [{"id": "position_signal", "scale": SCALE}]}],
        remote={"token_env": TOKEN_ENV, "timeout_s": 60}, **overrides,
    ))


def assert_batch_holds_the_remote_values(config, step: int = 1):
    storage = RunStorage(config.storage, config.name)
    branches = {(t.id, b.index): b for t in read_traces(storage, step) for b in t.branches}
    samples = read_batch(storage, step)
    assert len(samples) == len(branches) == 8  # every branch of 2 examples x 4 rollouts
    for sample in samples:
        branch = branches[(sample.trace_id, sample.branch_index)]
        mask = branch.sampled & (np.arange(len(branch)) > 0)
        expected = np.where(mask, (SCALE * np.arange(1, len(branch) + 1)).astype(np.float32), np.float32(0))
        assert np.array_equal(sample.rl_mask, mask) and mask.any()
        assert sample.rl_values.dtype == np.float32 and np.array_equal(sample.rl_values, expected)
        assert not sample.ce_mask.any()


def test_a_training_step_trains_on_the_env_servers_channel_values(prefect_api, tmp_path, token_file, token):
    from flows.train import run_training

    with env_server("--token-file", str(token_file)) as url:
        config = remote_config(str(tmp_path), "remote-values", url)
        run_training(config)
    assert_batch_holds_the_remote_values(config)
    [run] = step_runs(prefect_api, "remote-values")
    assert run["tasks"] == [(name, "Completed") for name in STAGES]


def test_partial_rollouts_train_on_the_env_servers_channel_values(prefect_api, tmp_path, token_file, token):
    """The env server runs the env's algorithms only (its rollouts play in the trainer's process), so rollouts
    continued across steps reach it as any others, their per-token versions with them."""
    from flows.train import run_training

    partial = {"async": {"max_off_policy_steps": 1, "partial_rollout_tokens": 3},
               "model": {"name": "tiny", "stop_tokens": ["<|im_end|>", *"etaoinshr"]}}
    with env_server("--token-file", str(token_file)) as url:
        config = remote_config(str(tmp_path), "remote-partial", url, steps=2, **partial)
        run_training(config)
    storage = RunStorage(config.storage, config.name)
    for step in (1, 2):
        assert_batch_holds_the_remote_values(config, step)
    assert storage.read_json(storage.step_path(2, "metrics.json"))["partial/carried_tokens"] > 0


def test_a_run_whose_server_is_down_is_refused_before_step_1_and_runs_once_it_is_up(prefect_api, tmp_path,
                                                                                    token_file, token):
    """A server down at the start is refused before any step (docs/pipeline.md); one that dies inside a step fails
    that step, which the resume completes: tests/faults/test_env_server_killed.py."""
    from flows.train import run_training
    from trace_rl.errors import RefusedError

    port = free_port()
    config = remote_config(str(tmp_path), "remote-down", f"http://127.0.0.1:{port}")
    storage = RunStorage(config.storage, config.name)
    with pytest.raises(RefusedError, match=f"env.0.server = 'http://127.0.0.1:{port}' does not answer"):
        run_training(config)
    assert not storage.exists(storage.step_path(1, "traces.parquet")) and step_runs(prefect_api, "remote-down") == []

    with env_server("--token-file", str(token_file), port=port):
        run_training(config)
    assert_batch_holds_the_remote_values(config)
    [run] = step_runs(prefect_api, "remote-down")
    assert run["tasks"] == [(name, "Completed") for name in STAGES]
