"""The embedded Prefect server: one real `prefect server start` process per machine, reused by every run.

It binds 127.0.0.1, keeps its SQLite database under `$TRACE_RL_HOME/prefect` (default
`~/.trace-rl/prefect`), and is started on first use. `PREFECT_API_URL` (or `[prefect]
api_url`) points runs at any other server instead. This module only manages the process
(it does not import prefect), so the library stays free of Prefect.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

DEFAULT_PORT = 4200
STARTUP_TIMEOUT_S = 120


def home() -> Path:
    return Path(os.environ.get("TRACE_RL_HOME", Path.home() / ".trace-rl"))


def state_file() -> Path:
    return home() / "prefect" / "server.json"


_HTTP = httpx.Client(timeout=2.0)  # one client: building an SSL context per probe costs ~0.4 s


def healthy(api_url: str) -> bool:
    try:
        return _HTTP.get(f"{api_url.rstrip('/')}/health").status_code == 200
    except httpx.HTTPError:
        return False


def status() -> dict | None:
    """The embedded server's record if its process is up and answering, else None."""
    path = state_file()
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return record if healthy(record["api_url"]) else None


def server_env(port: int) -> dict[str, str]:
    prefect_home = home() / "prefect"
    return {
        **os.environ,
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
        "DO_NOT_TRACK": "1",
    }


def start(port: int | None = None) -> dict:
    """Start the server (or return the running one) and wait until it answers."""
    running = status()
    if running:
        return running
    port = port or int(os.environ.get("TRACE_RL_PREFECT_PORT", DEFAULT_PORT))
    api_url = f"http://127.0.0.1:{port}/api"
    if healthy(api_url):
        raise RuntimeError(
            f"a server trace-rl did not start already answers at {api_url}; point runs at it with "
            f"PREFECT_API_URL={api_url}, or pick another port with TRACE_RL_PREFECT_PORT"
        )
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path.parent / "server.log", "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=server_env(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not healthy(api_url):
        if process.poll() is not None:
            raise RuntimeError(f"prefect server exited with {process.returncode}; see {path.parent / 'server.log'}")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"prefect server did not answer at {api_url} within {STARTUP_TIMEOUT_S}s")
        time.sleep(0.5)
    record = {"pid": process.pid, "api_url": api_url, "ui_url": f"http://127.0.0.1:{port}"}
    path.write_text(json.dumps(record))
    return record


def stop() -> bool:
    path = state_file()
    if not path.exists():
        return False
    record = json.loads(path.read_text())
    try:
        os.killpg(record["pid"], signal.SIGTERM)
    except ProcessLookupError:
        pass
    path.unlink()
    return True


def ensure_api_url(configured: str | None = None) -> str:
    """The Prefect API every run and child process talks to; starts the embedded server if none is set."""
    api_url = os.environ.get("PREFECT_API_URL") or configured
    if not api_url:
        api_url = start()["api_url"]
    os.environ["PREFECT_API_URL"] = api_url
    return api_url
