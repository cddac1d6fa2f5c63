"""The MCP tool servers of one verifiers rollout, as trace-rl's chat harness calls them.

verifiers hands a harness `mcp_urls` (server name -> streamable-HTTP URL): the task's servers it started for the
rollout (`Task.toolsets`) and the taskset's shared ones. Each server's tools are offered to the model as
`<server>_<tool>` (bare when the server's name is empty), as verifiers' own chat program names them. Every call
opens a fresh client, so a server that crashed is asked again on the next call.

Whatever goes wrong with one call becomes the tool message the model reads next, never an exception: a tool that
does not exist, arguments that are not a JSON object, a server that fails, does not answer within the harness's
`tool_timeout` or no longer accepts connections (it crashed). A server that cannot list its tools when the rollout
starts fails the episode (verifiers records the error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any
from urllib.parse import urlsplit


@contextlib.asynccontextmanager
async def mcp_client(url: str, timeout: float):
    """An MCP client of the server at `url`; everything it does, its closing included, ends `timeout` seconds
    after it opens (TimeoutError). The deadline is one anyio cancel scope, which cancels the transport's own
    tasks too, and the HTTP client has no timeout of its own: a second deadline of the same length raced this
    one, and its ReadTimeout, raised in the transport's task group, came out as an ExceptionGroup."""
    import anyio
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

    with anyio.fail_after(timeout):
        async with create_mcp_http_client(timeout=httpx2.Timeout(None)) as http_client, \
                Client(streamable_http_client(url, http_client=http_client)) as client:
            yield client


async def listening(url: str, timeout: float = 5.0) -> bool:
    """Whether something accepts TCP connections at the URL's host and port. The MCP client does not fail on a
    refused connection (it waits out its timeout), so a server that crashed is found out this way."""
    parts = urlsplit(url)
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(parts.hostname, parts.port or (443 if parts.scheme == "https"
                                                                                     else 80))
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def result_text(blocks: list[Any]) -> str:
    """An MCP result's content as one text: text blocks joined by newlines, any other block as its repr."""
    return "\n".join(block.text if block.type == "text" else str(block) for block in blocks)


class ToolServers:
    """`tools = await ToolServers.connect(mcp_urls, timeout)`: `tools.schemas` (OpenAI function tools) and
    `await tools.call(name, arguments_json)` -> the tool message's content."""

    def __init__(self, urls: dict[str, str], timeout: float):
        self.urls = urls
        self.timeout = timeout
        self.schemas: list[dict[str, Any]] = []
        self.routes: dict[str, tuple[str, str]] = {}  # offered name -> (server url, the server's tool name)

    @classmethod
    async def connect(cls, urls: dict[str, str], timeout: float) -> ToolServers:
        """The servers' tools, listed once."""
        self = cls(urls, timeout)
        for server, url in urls.items():
            if not await listening(url):
                raise ConnectionError(f"MCP tool server {server!r} at {url} does not accept connections")
            async with mcp_client(url, self.timeout) as client:
                listed = await client.list_tools()
            for tool in listed.tools:
                name = f"{server}_{tool.name}" if server else tool.name
                if name in self.routes:
                    raise ValueError(f"two MCP tools are offered as {name!r}; give the servers distinct names")
                self.routes[name] = (url, tool.name)
                self.schemas.append({"type": "function", "function": {
                    "name": name, "description": tool.description or "", "parameters": tool.input_schema}})
        return self

    async def call(self, name: str, arguments: str | None) -> str:
        if name not in self.routes:
            known = ", ".join(sorted(self.routes)) or "none"
            return f"error: unknown tool {name!r} (the tools are: {known})"
        try:
            parsed = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return f"error: the arguments of {name} are not valid JSON ({exc.msg}); send a JSON object"
        if not isinstance(parsed, dict):
            return f"error: the arguments of {name} must be a JSON object, not {type(parsed).__name__}"
        url, tool = self.routes[name]
        if not await listening(url):
            return f"error: tool {name} failed: its server does not accept connections"
        try:
            async with mcp_client(url, self.timeout) as client:
                result = await client.call_tool(tool, parsed)
        except TimeoutError:
            return f"error: tool {name} did not answer within {self.timeout:g} s"
        except Exception as exc:  # noqa: BLE001 - a crashed or refusing server is the model's observation
            while isinstance(exc, ExceptionGroup):  # the transport's task group: what went wrong is inside
                exc = exc.exceptions[0]
            return f"error: tool {name} failed: {type(exc).__name__}: {exc}"
        text = result_text(result.content)
        return f"error: {text}" if result.is_error and not text.startswith("error") else text
