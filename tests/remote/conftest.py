"""Real env server processes on loopback, serving the test-only module `tests.remote.algos`."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, wait_for_port

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests.remote.algos"
TOKEN = "s3cret-test-token"
TOKEN_ENV = "TRACE_RL_TEST_ENV_SERVER_TOKEN"


def server_command(*args: str, allow: str = MODULE) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "env-server", "--allow", allow, *args]


@contextmanager
def env_server(*args: str, port: int | None = None, allow: str = MODULE):
    """Start `trace-rl env-server --allow <allow>` in its own process; yield its URL once it listens; stop it."""
    port = port or free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(server_command("--port", str(port), *args, allow=allow), cwd=REPO, stdout=log, stderr=log)
    try:
        try:
            wait_for_port(port, 60, proc)
        except (RuntimeError, TimeoutError):
            log.seek(0)
            raise RuntimeError(f"env server did not start:\n{log.read().decode()}") from None
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def server(token_file):
    """The shared server: a token, a 0.05 MiB request limit, room for two requests at once."""
    with env_server("--token-file", str(token_file), "--max-request-mb", "0.05", "--max-concurrent", "4") as url:
        yield url


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def get_health(url: str, token: str = TOKEN) -> httpx.Response:
    return httpx.get(f"{url}/health", headers=auth(token), timeout=10)
