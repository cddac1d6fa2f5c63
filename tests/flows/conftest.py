"""A real Prefect server process for the pipeline tests (one per test session), and small run configs."""

from __future__ import annotations

import os

import pytest

from tests.conftest import free_port


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    from trace_rl import prefect_server

    os.environ["TRACE_RL_PREFECT_PORT"] = str(free_port())
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-client"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    record = prefect_server.start()
    os.environ["PREFECT_API_URL"] = record["api_url"]
    yield record["api_url"]
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=5)  # send the session's last logs while the server is still up
    prefect_server.stop()


def small_config(storage: str, name: str, steps: int = 2, **overrides) -> dict:
    """A run that takes seconds on the hf sampler: 2 examples x 4 rollouts of reverse-text per step."""
    data = {
        "name": name, "steps": steps, "seed": 3, "storage": storage,
        "inference": {"backend": "hf"},
        "sampling": {"max_completion_tokens": 8},
        "env": [{"id": "reverse-text", "batch_size": 2, "group_size": 4}],
        "trainer": {"lr": 1e-3, "micro_batch_tokens": 512},
    }
    for key, value in overrides.items():
        data[key] = value
    return data
