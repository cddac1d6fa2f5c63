"""The env server: runs env-owned algorithms for a trainer in another process (`trace-rl env-server`).

It imports what its allow-list (`--allow module` or `--allow module:Class`) names, at start and
nothing else: a request can only run the builtins and the algorithms the list allows, never make
the server import a module. It answers `GET /health` and `POST /run_algorithms` (see
trace_rl.remote.wire and docs/remote.md). Model runtimes are rebuilt from the request's
plain-data configs on first use and kept in a bounded cache (least recently used evicted).
Every limit it enforces answers with its own status and a message naming the limit: 400
(malformed or too deeply nested JSON), 401 (token), 403 (not allowed), 413 (size), 429 (rate),
503 (busy), 504 (timeout).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request, Response
from pydantic import ValidationError

from trace_rl.algorithms.base import Algorithm, AlgorithmError
from trace_rl.algorithms.registry import ALGORITHMS
from trace_rl.algorithms.runner import apply_algorithms, load_algorithms
from trace_rl.data.trace import TraceError
from trace_rl.imports import ImportPathError, import_path
from trace_rl.inference.build import build_runtime
from trace_rl.models.runtime import ModelRuntime, RuntimeConfig
from trace_rl.remote.wire import (
    PROTOCOL_VERSION,
    AlgorithmResult,
    ErrorReply,
    Health,
    RunReply,
    RunRequest,
    WireChannel,
)

log = logging.getLogger("trace_rl.env_server")


class EnvServerError(ValueError):
    """A server that must not start as asked (bad module, token file or bind address)."""


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 64 * 2**20
    request_timeout_s: float = 300.0
    max_concurrent: int = 8
    max_models: int = 4
    rate_per_s: float = 100.0  # per token (per client address without one); 0 = unlimited


@dataclass(frozen=True)
class Allowed:
    """What the server may run: the builtins plus what `--allow` named, by algorithm id."""

    algorithms: frozenset[str]
    health: Health = field(compare=False)

    def check(self, algorithm_id: str) -> None:
        if algorithm_id not in self.algorithms:
            raise Refused(403, f"algorithm {algorithm_id!r} is not on this server's allow-list "
                               f"({', '.join(self.health.algorithms) or 'builtins only'}); "
                               f"start the server with --allow module:Class for it")


class Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


class RuntimeCache:
    """Built runtimes by their config, at most `size` of them: building one more evicts the least recently
    used (a client cycling through model configs cannot make the server hold them all)."""

    def __init__(self, size: int):
        self.size = size
        self.built: OrderedDict[str, ModelRuntime] = OrderedDict()

    def get(self, config: RuntimeConfig) -> ModelRuntime:
        identity = config.model_dump_json()
        if identity in self.built:
            self.built.move_to_end(identity)
        else:
            while len(self.built) >= self.size:
                evicted, _ = self.built.popitem(last=False)
                log.info("evicted model runtime %s (--max-models %d)", evicted, self.size)
            self.built[identity] = build_runtime(config)
        return self.built[identity]


class RateLimiter:
    """A token bucket per client key: `rate` requests per second on average, bursts of up to 2 s worth."""

    def __init__(self, rate: float, max_clients: int = 1024):
        self.rate, self.burst, self.max_clients = rate, max(1.0, 2 * rate), max_clients
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, last refill)

    def wait_s(self, key: str) -> float:
        """0 if a request by `key` may go now (and count it), else the seconds until one may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens, last = self.buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
        self.buckets[key] = (tokens - 1 if wait == 0 else tokens, now)
        if len(self.buckets) > self.max_clients:
            self.buckets.popitem(last=False)
        return wait


class Runtimes(Mapping[str, ModelRuntime]):
    """The request's model runtimes by key, each built on first access from the server's cache."""

    def __init__(self, configs: Mapping[str, RuntimeConfig], cache: RuntimeCache):
        self.configs = configs
        self.cache = cache

    def __getitem__(self, key: str) -> ModelRuntime:
        return self.cache.get(self.configs[key])

    def __contains__(self, key: object) -> bool:
        return key in self.configs

    def __iter__(self) -> Iterator[str]:
        return iter(self.configs)

    def __len__(self) -> int:
        return len(self.configs)


def import_allowed(entries: list[str]) -> Allowed:
    """Import what each `--allow` entry names and return what requests may run.

    `module` allows every algorithm and env the module registers when imported; `module:Class` allows that
    one class (an Algorithm, by its registered id and by the path; or an env, listed by `/health`).
    """
    import trace_rl.algorithms.lookup  # noqa: F401  (registers the builtin algorithms)
    import trace_rl.envs.lookup  # noqa: F401  (registers the builtin envs)
    from trace_rl.envs.base import Environment
    from trace_rl.envs.registry import ENVIRONMENTS

    builtin_algorithms, builtin_envs = dict(ALGORITHMS), dict(ENVIRONMENTS)
    if os.getcwd() not in sys.path:  # like `python -m`: modules next to where the server starts are importable
        sys.path.insert(0, os.getcwd())
    classes: set[type] = set()
    paths: set[str] = set()
    for entry in entries:
        before = set(ALGORITHMS.values()) | set(ENVIRONMENTS.values())
        try:
            cls = import_path(entry, "--allow")
        except ImportPathError as exc:
            raise EnvServerError(str(exc)) from exc
        if ":" not in entry:
            added = (set(ALGORITHMS.values()) | set(ENVIRONMENTS.values())) - before
            if not added:
                raise EnvServerError(f"--allow {entry!r}: importing it registered no algorithm or env; allow its "
                                     "classes one by one with --allow module:Class")
            classes |= added
            continue
        if not (isinstance(cls, type) and issubclass(cls, (Algorithm, Environment))):
            raise EnvServerError(f"--allow {entry!r}: not an Algorithm or Environment class; name a class defined "
                                 "there, or allow the whole module")
        classes.add(cls)
        if issubclass(cls, Algorithm):
            paths.add(entry)
    registered = {id_ for id_, cls in ALGORITHMS.items() if cls in classes and id_ not in builtin_algorithms}
    # listed by their path
    unregistered = {path for path in paths if import_path(path, "--allow") not in ALGORITHMS.values()}
    envs = {id_ for id_, cls in ENVIRONMENTS.items() if cls in classes and id_ not in builtin_envs}
    return Allowed(frozenset(registered | paths | set(builtin_algorithms)),
                   Health(envs=sorted(envs), algorithms=sorted(registered | unregistered)))


def create_app(allowed: Allowed, limits: Limits = Limits(), tokens: frozenset[str] = frozenset()) -> FastAPI:
    app = FastAPI(title="trace-rl env server", docs_url=None, redoc_url=None, openapi_url=None)
    runtimes = RuntimeCache(limits.max_models)
    rates = RateLimiter(limits.rate_per_s)
    in_flight = 0

    def refuse(exc: Refused) -> Response:
        return Response(ErrorReply(error=str(exc)).model_dump_json(), exc.status, exc.headers, "application/json")

    def authorize(request: Request) -> str:
        """The client's key for rate limiting: its token, or its address where the server has none."""
        if not tokens:
            return request.client.host if request.client else "unknown"
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare with every token, so the time taken does not tell which one nearly matched
        matches = [hmac.compare_digest(given.strip().encode(), token.encode()) for token in tokens]
        if scheme.lower() != "bearer" or not any(matches):
            raise Refused(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' with a "
                               "token from the server's --token-file", {"WWW-Authenticate": "Bearer"})
        return given.strip()

    def limit_rate(client: str) -> None:
        wait = rates.wait_s(client)
        if wait > 0:
            raise Refused(429, f"rate limit: more than {limits.rate_per_s:g} requests per second with this token "
                               "(--rate-limit); retry later", {"Retry-After": str(max(1, round(wait)))})

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
        return Response(allowed.health.model_dump_json(), media_type="application/json")

    @app.post("/run_algorithms")
    async def post_run_algorithms(request: Request) -> Response:
        nonlocal in_flight
        try:
            limit_rate(authorize(request))
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
            errors = exc.errors()
            if any(error["type"] == "json_invalid" for error in errors):
                # pydantic's parser stops at a fixed nesting depth (~200), before building deeper levels
                raise Refused(400, f"the request body is not JSON the server reads: {describe(exc)}; send "
                                   "the run_algorithms body as trace_rl.remote.wire.RunRequest writes it") from None
            if errors[0]["type"] == "protocol_version":  # then the only error: nothing else was read
                raise Refused(400, errors[0]["msg"]) from None
            raise Refused(422, f"malformed run_algorithms request (protocol version {PROTOCOL_VERSION}): "
                               f"{describe(exc)}") from None
        for config in request.algorithms:
            allowed.check(config.id)
            if config.id == "echo" and config.options.get("filter") is not None:
                # the filter is an import path the server would import and call: not on any allow-list
                raise Refused(403, "echo's `filter` names code to import, which this server does not do for "
                                   "clients; run echo with a filter in the training process instead")
        traces = []
        for position, wire_trace in enumerate(request.traces):
            try:
                traces.append(wire_trace.to_trace())
            except TraceError as exc:
                raise Refused(422, f"malformed trace traces.{position} (protocol version {PROTOCOL_VERSION}): "
                                   f"{exc}") from None
        try:
            algorithms = await load_algorithms(request.algorithms, Runtimes(request.models, runtimes))
            for algorithm in algorithms:
                if algorithm.whole_step and not request.whole_step:
                    raise Refused(409, f"algorithm {algorithm.id!r} needs the whole step in one request "
                                       "(whole_step = true), got one group; the trainer then resends every group "
                                       "of the step at once")
            channels = await apply_algorithms(algorithms, traces)
        except AlgorithmError as exc:
            raise Refused(422, str(exc)) from None
        except Refused:
            raise
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


def read_tokens(token_file: str | None) -> frozenset[str]:
    """The bearer tokens in the file, one per line (one per client, each rate-limited on its own)."""
    if token_file is None:
        return frozenset()
    try:
        tokens = frozenset(line.strip() for line in Path(token_file).read_text().splitlines() if line.strip())
    except OSError as exc:
        raise EnvServerError(f"--token-file {token_file}: cannot read it ({exc})") from None
    if not tokens:
        raise EnvServerError(f"--token-file {token_file} is empty; put the bearer token in it")
    return tokens


def serve(allow: list[str], host: str = "127.0.0.1", port: int = 8765, token_file: str | None = None,
          limits: Limits = Limits()) -> None:
    """Check the bind and tokens, import what `allow` names, then serve until interrupted."""
    import uvicorn

    tokens = read_tokens(token_file)
    if not tokens and not is_loopback(host):
        raise EnvServerError(f"refusing to bind {host!r} without a token: anyone who can reach it could run "
                             "algorithms; pass --token-file FILE, or bind 127.0.0.1")
    allowed = import_allowed(allow)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    log.info("serving envs %s and algorithms %s", allowed.health.envs, allowed.health.algorithms)
    uvicorn.run(create_app(allowed, limits, tokens), host=host, port=port, log_level="info")
