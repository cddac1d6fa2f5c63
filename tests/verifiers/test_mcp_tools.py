"""The chat harness's MCP calls (`trace_rl.verifiers.mcp_tools`): a call the servers cannot take is the model's
next observation, never an exception (the calls that reach a live server: tests/envs/test_verifiers_tools.py)."""

from __future__ import annotations

import asyncio

from tests.conftest import free_port
from trace_rl.verifiers.mcp_tools import ToolServers


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
