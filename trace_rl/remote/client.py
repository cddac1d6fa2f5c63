"""The trainer's side of the env server: run an env-owned algorithm remotely, get validated channels back.

`run_remote_algorithm` sends each group of traces to the server (groups concurrently, up to
`remote.max_concurrent`), retries what a second attempt may fix (refused connection, timeout,
429/5xx, a reply that breaks the wire format) with exponential backoff, and validates every
channel it gets exactly like a local one. Its result has the local runner's shape: the
algorithm's channels, group by group.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import numpy as np
from pydantic import ValidationError

from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.aio import gather_or_cancel
from trace_rl.algorithms.lookup import resolve_algorithm_class
from trace_rl.config import EnvConfig, RemoteConfig
from trace_rl.data.channel import Channel
from trace_rl.data.trace import Trace, group_traces
from trace_rl.data.validate import DimensionError, validate_channels
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.remote.wire import PROTOCOL_VERSION, ErrorReply, RunReply, RunRequest, WireTrace

log = logging.getLogger("trace_rl.remote")


class RemoteAlgorithmError(RuntimeError):
    """An env server refused the request, or kept failing after every retry."""


class Retryable(Exception):
    """A failure a later attempt may not hit."""


class NeedsWholeStep(Exception):
    """The server answered 409: the algorithm needs every group of the step in one request."""


def remote_server_for(env: EnvConfig, algorithm: AlgorithmConfig) -> str | None:
    """The env's server URL when `algorithm` is neither builtin nor importable here, else None (run it locally)."""
    if env.algorithm_server is None or resolve_algorithm_class(algorithm.id) is not None:
        return None
    return env.algorithm_server


def auth_headers(options: RemoteConfig) -> dict[str, str]:
    token = os.environ.get(options.token_env, "").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


async def run_remote_algorithm(
    server_url: str,
    algorithm: AlgorithmConfig | Mapping[str, Any] | str,
    traces: list[Trace],
    runtime_configs: Mapping[str, RuntimeConfig],
    options: RemoteConfig,
) -> list[Channel]:
    """Run `algorithm` on every group of `traces` on the env server; its validated channels, group by group."""
    config = AlgorithmConfig.parse(algorithm)
    limit = asyncio.Semaphore(options.max_concurrent)
    async with httpx.AsyncClient(timeout=options.timeout_s, headers=auth_headers(options)) as client:

        async def one_group(group: list[Trace]) -> list[Channel]:
            async with limit:
                return (await run_group(client, server_url, [config], group, runtime_configs, options))[0]

        groups = list(group_traces(traces).values())
        try:
            per_group = await gather_or_cancel(one_group(group) for group in groups)
        except NeedsWholeStep:
            # the algorithm needs batch-level statistics (Algorithm.whole_step): every group in one request
            ordered = [trace for group in groups for trace in group]
            return (await run_group(client, server_url, [config], ordered, runtime_configs, options,
                                    whole_step=True))[0]
    return [channel for channels in per_group for channel in channels]


async def run_group(
    client: httpx.AsyncClient,
    server_url: str,
    configs: Sequence[AlgorithmConfig],
    group: list[Trace],
    runtime_configs: Mapping[str, RuntimeConfig],
    options: RemoteConfig,
    whole_step: bool = False,
) -> list[list[Channel]]:
    """One run_algorithms call with retries: per algorithm (in order), its validated channels on `group` (or, with
    `whole_step`, on every group of the step)."""
    body = RunRequest(algorithms=list(configs), models=dict(runtime_configs), whole_step=whole_step,
                      traces=[WireTrace.of(trace) for trace in group]).model_dump_json()
    url = server_url.rstrip("/") + "/run_algorithms"
    source = f"env server {server_url}"
    what = (f"algorithm {', '.join(repr(c.id) for c in configs)} on "
            + (f"the whole step ({len(group)} traces)" if whole_step else f"group {group[0].group_id!r}"))
    attempts = options.max_retries + 1
    for attempt in range(attempts):
        try:
            response = await client.post(url, content=body, headers={"Content-Type": "application/json"})
            if response.status_code == 409 and not whole_step:
                raise NeedsWholeStep(error_message(response))
            if response.status_code == 429 or response.status_code >= 500:
                raise Retryable(f"HTTP {response.status_code}: {error_message(response)}")
            if response.status_code != 200:
                raise RemoteAlgorithmError(
                    f"{source} refused {what}: HTTP {response.status_code}: {error_message(response)}")
            return parse_reply(response.content, configs, group, source)
        except httpx.TimeoutException:
            problem = f"no reply within {options.timeout_s:g}s (remote.timeout_s)"
        except httpx.TransportError as exc:
            problem = f"cannot reach the server ({type(exc).__name__}: {exc})"
        except Retryable as exc:
            problem = str(exc)
        if attempt + 1 < attempts:
            delay = options.retry_backoff_s * 2**attempt
            log.warning("%s: %s: %s; retry %d/%d in %.3gs", source, what, problem, attempt + 1, options.max_retries,
                        delay)
            await asyncio.sleep(delay)
    raise RemoteAlgorithmError(f"{source}: {what} failed after {attempts} attempts "
                               f"(remote.max_retries = {options.max_retries}); last error: {problem}")


def error_message(response: httpx.Response) -> str:
    try:
        return ErrorReply.model_validate_json(response.content).error
    except ValidationError:
        return response.text[:500] or "(empty body)"


def parse_reply(content: bytes, configs: Sequence[AlgorithmConfig], group: list[Trace], source: str):
    """Channels per algorithm from a reply. A reply breaking the wire format is Retryable; channels that
    do not fit their branches raise DimensionError naming the server, algorithm, trace and branch."""
    try:
        reply = RunReply.model_validate_json(content)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:3])
        raise Retryable(f"malformed reply: {details}") from None
    if reply.version != PROTOCOL_VERSION:
        raise Retryable(f"malformed reply: protocol version {reply.version}, expected {PROTOCOL_VERSION}")
    returned = [result.algorithm_id for result in reply.results]
    if returned != [config.id for config in configs]:
        raise Retryable(f"malformed reply: results for algorithms {returned}, asked for {[c.id for c in configs]}")
    per_algorithm = []
    for config, result in zip(configs, reply.results):
        channels = [
            Channel(algorithm_id=config.id, loss=wire.loss, trace_id=wire.trace_id, branch_index=wire.branch_index,
                    values=np.asarray(wire.values, np.float64), mask=np.asarray(wire.mask, np.bool_))
            for wire in result.channels
        ]
        seen = set()
        for channel in channels:
            if (channel.trace_id, channel.branch_index) in seen:
                raise DimensionError(f"{source}: trace {channel.trace_id!r} branch {channel.branch_index} algorithm "
                                     f"{config.id!r}: the reply has two channels for this branch; an algorithm sets "
                                     "at most one per branch")
            seen.add((channel.trace_id, channel.branch_index))
        validate_channels(group, channels, source=source)
        for channel in channels:
            channel.values = channel.values.astype(np.float32)
        per_algorithm.append(channels)
    return per_algorithm
