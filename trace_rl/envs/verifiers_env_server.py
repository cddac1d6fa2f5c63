"""A verifiers env server for a run's `[[env]] id = "verifiers"` with `server = "tcp://HOST:PORT"`
(`trace-rl verifiers-env-server CONFIG`, docs/remote.md): verifiers' own server (`verifiers.v1.serve.serve_env`) on
the env's `[env.args]`, resolved as the in-process env resolves them (trace-rl's chat harness for a seat that names
none), bound at the env's `server` address.

verifiers 0.4.0 samples a train client's turns through `renderers` 0.1.12, which reads each sampled token's logprob
as `{"token": "token_id:N", "logprob": x}` (vLLM's text-mode shape); vllm 0.32's `/inference/v1/generate` answers
`{"token_id": N, "logprob": x}` in its default tokens mode, and renderers never asks for text mode. `accept_token_mode`
gives renderers' check the shape it expects, so every other check it makes (one entry per sampled token, the same
ids, finite logprobs) still applies.
"""

from __future__ import annotations

from typing import Any

from trace_rl.envs.lookup import add_import_paths
from trace_rl.envs.verifiers_env import env_config


def accept_token_mode() -> None:
    """Let renderers' generate client read vLLM's tokens-mode logprobs (idempotent)."""
    import renderers.client as client

    original = client._parse_completion_logprobs
    if getattr(original, "trace_rl_token_mode", False):
        return

    def parse_completion_logprobs(choice: dict[str, Any], completion_ids: list[int]) -> list[float]:
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            content = [{**entry, "token": f"token_id:{entry['token_id']}"}
                       if isinstance(entry, dict) and "token" not in entry and "token_id" in entry else entry
                       for entry in logprobs["content"]]
            choice = {**choice, "logprobs": {**logprobs, "content": content}}
        return original(choice, completion_ids)

    parse_completion_logprobs.trace_rl_token_mode = True
    client._parse_completion_logprobs = parse_completion_logprobs


def serve(args: dict[str, Any], address: str, import_paths: list[str]) -> None:
    """Serve the verifiers env of `args` (an `[env.args]`) at `address` until interrupted, in this process (verifiers'
    pool of worker processes would not have the chat harness and `accept_token_mode`)."""
    add_import_paths(import_paths)
    config = env_config(args)
    import trace_rl.verifiers.harness  # noqa: F401 - verifiers imports the chat harness by its module name
    from verifiers.v1.serve import serve_env

    accept_token_mode()
    serve_env(config=config, address=address, max_workers=1)
