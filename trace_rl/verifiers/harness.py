"""The chat harness trace-rl gives a verifiers agent that names none: in this process, no program, no sandbox, no
download. Each segment posts the conversation so far as one chat completion to the rollout's interception endpoint
(verifiers records the turn and samples it through the rollout's client) and ends.

verifiers loads a harness by id, importing the module the id names (`trace-rl-chat` -> `trace_rl_chat`) and taking
the `vf.Harness` subclass in its `__all__`; importing this module makes it importable under that name.
"""

from __future__ import annotations

import sys

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

HARNESS_ID = "trace-rl-chat"
sys.modules.setdefault(HARNESS_ID.replace("-", "_"), sys.modules[__name__])


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion per segment; a later segment (a user's reply) resumes on the accreted conversation."""

    APPENDS_SYSTEM_PROMPT = True
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
        async with httpx.AsyncClient(timeout=None) as client:
            response = await client.post(f"{endpoint.rstrip('/')}/chat/completions",
                                         headers={"Authorization": f"Bearer {secret}"},
                                         json={"model": ctx.model, "messages": messages})
        if response.status_code != 200:
            return vf.ProgramResult(exit_code=1, stdout="", stderr=f"HTTP {response.status_code}: {response.text}")
        return vf.ProgramResult(exit_code=0, stdout=response.text, stderr="")


__all__ = ["ChatHarness", "ChatHarnessConfig"]
