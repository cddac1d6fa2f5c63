"""The vLLM server a run samples from is SIGKILLed while it samples: the rollouts retry, then the step fails
cleanly (its error fraction past `[env] max_error_fraction`) with nothing of it written; once a server is
back on the same address, `--resume` finishes the run, loading the run's weights into the fresh server."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.faults.conftest import write_config
from tests.flows.test_crash_resume import finish, output, start
from tests.flows.test_engine_death import sampling
from trace_rl.inference.build import build_runtime
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.storage import RunStorage

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.vllm]


def test_vllm_server_killed_while_sampling_then_back(prefect_api, tmp_path, tiny_model_path, vllm_server):
    name = "vllm-server-killed"
    # 32 rollouts of 128 tokens: step 2 samples for seconds, long enough to be killed inside
    config = write_config(tmp_path, name, str(tmp_path / "runs"), steps=2,
                          inference={"backend": "vllm", "base_url": vllm_server.url, "max_retries": 2,
                                     "retry_backoff_s": 0.5},
                          sampling={"max_completion_tokens": 128},
                          env=[{"id": "reverse-text", "batch_size": 4, "group_size": 8}])
    storage = RunStorage(str(tmp_path / "runs"), name)
    process = start(config)
    deadline = time.monotonic() + 300
    # step 1's metrics.json is written after its broadcast: the server's next work is step 2's sampling
    step_2_sampling = sampling(vllm_server.process, storage, 2)
    while not step_2_sampling():
        assert process.poll() is None and time.monotonic() < deadline, output(process)[-3000:]
        time.sleep(0.01)
    os.killpg(vllm_server.process.pid, signal.SIGKILL)
    vllm_server.process.wait()
    process.wait(timeout=300)
    err = output(process)
    assert process.returncode != 0, err[-3000:]
    assert "rollouts failed" in err and "more than env.0.max_error_fraction = 0.5" in err, err[-3000:]
    assert "ConnectError" in err, err[-3000:]
    assert storage.stable_steps("weights") == [1] and not storage.exists(storage.step_path(2, "traces.parquet"))

    vllm_server.restart()  # a new server on the same address
    try:
        finish(start(config, "--resume"))
        assert storage.stable_steps("weights") == [1, 2]
    finally:  # the session's server serves the tiny model's own weights to the tests after this one
        runtime = build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="vllm",
                                              base_urls=[vllm_server.url]))
        asyncio.run(runtime.load_weights(tiny_model_path, 0))
