"""The chat harness's MCP calls (`trace_rl.verifiers.mcp_tools`): a call the servers cannot take is the model's
next observation, never an exception (the calls that reach a live server: tests/envs/test_verifiers_tools.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port, wait_for_port
from trace_rl.verifiers.mcp_tools import ToolServers

TASKSETS = str(Path(__file__).parents[1] / "envs" / "verifiers_tasksets")


def test_calls_the_servers_cannot_take_are_observations():
    tools = ToolServers({}, timeout=5.0)
    tools.routes["facts_lookup"] = (f"http://127.0.0.1:{free_port()}/mcp", "lookup")  # nothing listens there

    def call(name: str, arguments: str | None) -> str:
        return asyncio.run(tools.call(name, arguments))

    assert call("facts_nope", "{}") == "error: unknown tool 'facts_nope' (the tools are: facts_lookup)"
    assert call("facts_lookup", "{oops").startswith("error: the arguments of facts_lookup are not valid JSON")
    assert call("facts_lookup", "[1]") == "error: the arguments of facts_lookup must be a JSON object, not list"
    assert call("facts_lookup", '{"key": "oak"}') == \
        "error: tool facts_lookup failed: its server does not accept connections"


def test_a_call_past_its_timeout_on_a_held_event_loop_is_the_timeout_observation(tmp_path):
    """The tests' facts_tools server on the host; `facts_wait` outlives a 1 s timeout while the event loop is held
    past the deadline (a loaded machine). One deadline cuts the call: before, the HTTP client's read timeout of the
    same length fired too, and its ReadTimeout came back as 'failed: ExceptionGroup: unhandled errors in a
    TaskGroup' (4 calls of 4 here, with the loop held 0.3 s)."""
    port_file = tmp_path / "port"
    env = {**os.environ, "VF_CONFIG": "{}", "MCP_PORT_FILE": str(port_file), "PYTHONPATH": TASKSETS}
    server = subprocess.Popen([sys.executable, "-m", "facts_tools.server"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert server.poll() is None and time.monotonic() < deadline, "the facts server did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}/mcp"
        wait_for_port(int(port_file.read_text()), 30, server)

        async def calls() -> list[str]:
            tools = await ToolServers.connect({"facts": url}, timeout=1.0)

            async def hold_the_loop():
                await asyncio.sleep(0.95)
                time.sleep(0.3)

            holder = asyncio.ensure_future(hold_the_loop())
            answers = [await tools.call("facts_wait", '{"seconds": 60}')]
            await holder
            return [*answers, await tools.call("facts_lookup", '{"key": "oak"}')]

        assert asyncio.run(calls()) == ["error: tool facts_wait did not answer within 1 s", "a tree with acorns"]
    finally:
        server.kill()
        server.wait()
