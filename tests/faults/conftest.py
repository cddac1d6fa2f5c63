"""The fault-injection suite: real runs (`trace-rl train` processes) against real servers that are killed,
restarted or starved mid-step. Each test compares the weights a faulted-then-resumed run ends with against
an uninterrupted run of the same config."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w

from tests.flows.conftest import small_config
from tests.flows.test_crash_resume import finish, start

STEPS = 3


def write_config(directory: Path, name: str, storage: str, **overrides) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(tomli_w.dumps(small_config(storage, name, steps=STEPS, **overrides)))
    return path


def model_bytes(storage, step: int = STEPS) -> bytes:
    """The safetensors of the weights a run exported after `step`, read through its storage (any fsspec URL)."""
    return storage.read_bytes(storage.path("weights", f"{step:06d}", "model.safetensors"))


@pytest.fixture(scope="session")
def uninterrupted(prefect_api, tmp_path_factory) -> bytes:
    """The final weights of a run of the faults suite's config that nothing interrupts."""
    from trace_rl.storage import RunStorage

    directory = tmp_path_factory.mktemp("uninterrupted")
    finish(start(write_config(directory, "uninterrupted", str(directory / "runs"))))
    return model_bytes(RunStorage(str(directory / "runs"), "uninterrupted"))
