"""The chat harness trace-rl gives a verifiers agent that names none: in this process, no program, no sandbox, no
download. Each segment posts the conversation so far as one chat completion to the rollout's interception endpoint
(verifiers records the turn and samples it through the rollout's client), runs the tool calls of the reply on the
rollout's MCP tool servers (`trace_rl.verifiers.mcp_tools`), appends their results and posts again, until a reply
calls no tool or verifiers refuses the turn (the agent's `max_turns`, a @stop, the context length).

verifiers hands a harness the URLs a program inside the rollout's runtime reaches: a container runtime routes the
host's loopback through a proxy listening in the container's network (`runtime.host_url`). This harness runs here,
so it takes each URL back to the host's (`host_side`).

verifiers loads a harness by id, importing the module the id names (`trace-rl-chat` -> `trace_rl_chat`) and taking
the `vf.Harness` subclass in its `__all__`; importing this module makes it importable under that name.
"""

from __future__ import annotations

import sys
from urllib.parse import urlsplit, urlunsplit

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from trace_rl.verifiers.mcp_tools import ToolServers

HARNESS_ID = "trace-rl-chat"
sys.modules.setdefault(HARNESS_ID.replace("-", "_"), sys.modules[__name__])


def host_side(runtime, url: str) -> str:
    """The host URL that `runtime.host_url` routed as `url` (unchanged where it routes nothing: the subprocess
    runtime). verifiers 0.4.0's docker/podman runtime keeps its routes in its egress proxy, by token."""
    from verifiers.v1.runtimes.docker.egress import _CALLBACK_PREFIX

    proxy = getattr(runtime, "_proxy", None)
    parts = urlsplit(url)
    if proxy is None or not parts.path.startswith(_CALLBACK_PREFIX):
        return url
    token, _, path = parts.path[len(_CALLBACK_PREFIX):].partition("/")
    route = proxy._callbacks[token]
    return urlunsplit((route.scheme, route.authority, f"/{path}", parts.query, parts.fragment))


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """Chat completions with tool calls run between them; a later segment (a user's reply) resumes on the accreted
    conversation."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint: str, secret: str, mcp_urls: dict[str, str], data,
                     tool_interception_url: str | None = None) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(message) for message in prompt or []]
        endpoint = host_side(runtime, endpoint)
        tools = await ToolServers.connect({name: host_side(runtime, url) for name, url in mcp_urls.items()},
                                          self.config.tool_timeout)
        async with httpx.AsyncClient(timeout=None) as client:
            body = {"model": ctx.model, "messages": messages}
            if tools.schemas:
                body["tools"] = tools.schemas
            while True:
                response = await client.post(f"{endpoint.rstrip('/')}/chat/completions",
                                             headers={"Authorization": f"Bearer {secret}"}, json=body)
                if response.status_code != 200:  # verifiers refused the turn; a stopped rollout expects that
                    return vf.ProgramResult(exit_code=1, stdout="",
                                            stderr=f"HTTP {response.status_code}: {response.text}")
                message = response.json()["choices"][0]["message"]
                messages.append({key: value for key, value in message.items() if value is not None})
                if not message.get("tool_calls"):
                    return vf.ProgramResult(exit_code=0, stdout=response.text, stderr="")
                for call in message["tool_calls"]:
                    content = await tools.call(call["function"]["name"], call["function"].get("arguments"))
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})


__all__ = ["ChatHarness", "ChatHarnessConfig"]
