"""The fault-injection suite: real runs (`trace-rl train` processes) against real servers that are killed,
restarted or starved mid-step. Each test compares the weights a faulted-then-resumed run ends with against
an uninterrupted run of the same config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import tomli_w

from tests.flows.conftest import small_config

STEPS = 3


def write_config(directory: Path, name: str, storage: str, steps: int = STEPS, **overrides) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(tomli_w.dumps(small_config(storage, name, steps=steps, **overrides)))
    return path


class DurableMoto:
    """moto's S3 server on loopback that can be SIGKILLed and restarted with its objects.

    moto keeps objects in memory; its recorder journals every request to a file as it arrives
    (MOTO_ENABLE_RECORDING), and a restarted server replays that journal: the state at the kill, the way a
    real S3 endpoint that crashed keeps what it had accepted."""

    def __init__(self, directory: Path):
        from tests.conftest import free_port

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.journal = directory / "moto-journal.jsonl"
        self.process: subprocess.Popen | None = None

    def start(self, die_at: str | None = None) -> None:
        """Start (again, with the objects it had accepted); with `die_at`, it SIGKILLs itself when a request
        'METHOD /path' starting with it arrives (tests/faults/moto_restored.py)."""
        from tests.conftest import wait_for_port

        env = {**os.environ, "MOTO_ENABLE_RECORDING": "true", "MOTO_RECORDER_FILEPATH": str(self.journal)}
        self.journal.touch()
        # the journal is replayed before the port opens: a retrying client never sees a half-restored server
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.moto_restored", str(self.journal), str(self.port),
             *([die_at] if die_at else [])],
            cwd=Path(__file__).resolve().parents[2], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, 120, self.process)

    def kill(self) -> None:
        """SIGKILL; the request it was journaling when killed (a last line without its newline) is dropped, as
        the server never answered it, so the restarted server's entries start on a line of their own."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.drop_half_written_entry()

    def drop_half_written_entry(self) -> None:
        journal = self.journal.read_bytes()
        with open(self.journal, "r+b") as file:
            file.truncate(journal.rfind(b"\n") + 1)

    def requests(self) -> list[str]:
        """'METHOD path' of every request the server has received, in order."""
        if not self.journal.exists():
            return []
        lines = self.journal.read_text().splitlines()
        entries = [json.loads(line) for line in lines[:-1]]  # the last line may be half-written
        return [f"{entry['method']} {urlsplit(entry['url']).path}" for entry in entries]


@pytest.fixture
def durable_s3(tmp_path):
    server = DurableMoto(tmp_path)
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    server.start()
    httpx.put(f"{server.endpoint}/faults", timeout=10).raise_for_status()  # the bucket
    yield server
    if server.process.poll() is None:
        server.process.terminate()
        server.process.wait(10)
