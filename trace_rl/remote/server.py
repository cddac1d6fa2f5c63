"""The env server: runs env-owned algorithms for a trainer in another process (`trace-rl env-server`).

It imports the given modules (their `register` / `register_env` calls add algorithms and envs),
then answers `GET /health` and `POST /run_algorithms` (see trace_rl.remote.wire and
docs/remote.md). Model runtimes are rebuilt from the request's plain-data configs on first
use and cached for the server's lifetime. Every limit it enforces answers with its own status
and a message naming the limit: 401 (token), 503 (busy), 413 (size), 504 (timeout).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import ipaddress
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request, Response
from pydantic import ValidationError

from trace_rl.algorithms.base import REGISTRY, AlgorithmError
from trace_rl.algorithms.runner import load_algorithms, run_algorithms
from trace_rl.models import ModelRuntime, RuntimeConfig, build_runtime
from trace_rl.remote.wire import (
    PROTOCOL_VERSION, AlgorithmResult, ErrorReply, Health, RunReply, RunRequest, WireChannel,
)
from trace_rl.trace import Trace, TraceError

log = logging.getLogger("trace_rl.env_server")


class EnvServerError(ValueError):
    """A server that must not start as asked (bad module, token file or bind address)."""


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 64 * 2**20
    request_timeout_s: float = 300.0
    max_concurrent: int = 8


class Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


class Runtimes(Mapping[str, ModelRuntime]):
    """The request's model runtimes by key, each built on first access and shared across requests."""

    def __init__(self, configs: Mapping[str, RuntimeConfig], cache: dict[str, ModelRuntime]):
        self.configs = configs
        self.cache = cache

    def __getitem__(self, key: str) -> ModelRuntime:
        config = self.configs[key]
        identity = config.model_dump_json()
        if identity not in self.cache:
            self.cache[identity] = build_runtime(config)
        return self.cache[identity]

    def __contains__(self, key: object) -> bool:
        return key in self.configs

    def __iter__(self) -> Iterator[str]:
        return iter(self.configs)

    def __len__(self) -> int:
        return len(self.configs)


def import_modules(modules: list[str]) -> Health:
    """Import the modules (running their registrations) and report the envs and algorithms they added."""
    import trace_rl.algorithms.builtins  # noqa: F401
    import trace_rl.envs.builtins  # noqa: F401
    from trace_rl.envs.base import ENVIRONMENTS

    envs_before, algorithms_before = set(ENVIRONMENTS), set(REGISTRY)
    if os.getcwd() not in sys.path:  # like `python -m`: modules next to where the server starts are importable
        sys.path.insert(0, os.getcwd())
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise EnvServerError(f"--module {name}: cannot import it ({exc})") from exc
    return Health(envs=sorted(set(ENVIRONMENTS) - envs_before), algorithms=sorted(set(REGISTRY) - algorithms_before))


def create_app(health: Health, limits: Limits = Limits(), token: str | None = None) -> FastAPI:
    app = FastAPI(title="trace-rl env server", docs_url=None, redoc_url=None, openapi_url=None)
    runtimes: dict[str, ModelRuntime] = {}
    in_flight = 0

    def refuse(exc: Refused) -> Response:
        return Response(ErrorReply(error=str(exc)).model_dump_json(), exc.status, exc.headers, "application/json")

    def authorize(request: Request) -> None:
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise Refused(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the "
                               "token from the server's --token-file", {"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        too_large = Refused(413, f"request body exceeds the server's limit of {limits.max_request_bytes} bytes "
                                 "(--max-request-mb); send fewer or shorter traces per request")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_request_bytes:
                raise too_large
        return bytes(body)

    @app.get("/health")
    async def get_health(request: Request) -> Response:
        try:
            authorize(request)
        except Refused as exc:
            return refuse(exc)
        return Response(health.model_dump_json(), media_type="application/json")

    @app.post("/run_algorithms")
    async def post_run_algorithms(request: Request) -> Response:
        nonlocal in_flight
        try:
            authorize(request)
            if in_flight >= limits.max_concurrent:
                raise Refused(503, f"server busy: {in_flight} requests in flight, the limit is "
                                   f"{limits.max_concurrent} (--max-concurrent); retry later", {"Retry-After": "1"})
            in_flight += 1
            try:
                reply = await asyncio.wait_for(run(request), limits.request_timeout_s)
            except TimeoutError:
                raise Refused(504, f"run_algorithms took longer than the server's limit of "
                                   f"{limits.request_timeout_s:g}s (--request-timeout-s)") from None
            finally:
                in_flight -= 1
        except Refused as exc:
            return refuse(exc)
        return Response(reply.model_dump_json(), media_type="application/json")

    async def run(http_request: Request) -> RunReply:
        try:
            request = RunRequest.model_validate_json(await read_body(http_request))
        except ValidationError as exc:
            raise Refused(422, f"malformed run_algorithms request: {describe(exc)}") from None
        if request.version != PROTOCOL_VERSION:
            raise Refused(400, f"protocol version {request.version} is not supported; "
                               f"this server speaks version {PROTOCOL_VERSION}")
        try:
            traces = [Trace.from_dict(data) for data in request.traces]
        except (TraceError, TypeError, ValueError) as exc:
            raise Refused(422, f"malformed trace: {exc}") from None
        try:
            algorithms = await load_algorithms(request.algorithms, Runtimes(request.models, runtimes))
            channels = await run_algorithms(algorithms, traces)
        except AlgorithmError as exc:
            raise Refused(422, str(exc)) from None
        except Exception as exc:
            log.exception("run_algorithms failed")
            ids = ", ".join(repr(config.id) for config in request.algorithms)
            raise Refused(500, f"algorithms [{ids}] failed: {type(exc).__name__}: {exc}") from None
        return RunReply(results=[
            AlgorithmResult(algorithm_id=algorithm.id, channels=[WireChannel.of(c) for c in channels[position]])
            for position, algorithm in enumerate(algorithms)
        ])

    return app


def describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()[:5])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None) -> str | None:
    if token_file is None:
        return None
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise EnvServerError(f"--token-file {token_file}: cannot read it ({exc})") from None
    if not token:
        raise EnvServerError(f"--token-file {token_file} is empty; put the bearer token in it")
    return token


def serve(modules: list[str], host: str = "127.0.0.1", port: int = 8765, token_file: str | None = None,
          limits: Limits = Limits()) -> None:
    """Check the bind and token, import the modules, then serve until interrupted."""
    import uvicorn

    token = read_token(token_file)
    if token is None and not is_loopback(host):
        raise EnvServerError(f"refusing to bind {host!r} without a token: anyone who can reach it could run "
                             "algorithms; pass --token-file FILE, or bind 127.0.0.1")
    health = import_modules(modules)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    log.info("serving envs %s and algorithms %s", health.envs, health.algorithms)
    uvicorn.run(create_app(health, limits, token), host=host, port=port, log_level="info")
