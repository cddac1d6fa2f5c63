"""The servers a run needs, checked before step 1 and before any engine starts: every env server answers `/health`
with the token, every verifiers env server answers its health request, and every vLLM server answers (its storage
is checked by `trace_rl.runs.start.check_run`).

A failure is one RefusedError naming the key and the fix, instead of a step that fails minutes later.
"""

from __future__ import annotations

import asyncio

import httpx

from trace_rl.config import Config
from trace_rl.errors import RefusedError
from trace_rl.remote.client import auth_headers

TIMEOUT_S = 10.0
VERIFIERS_TIMEOUT_S = 5.0  # ZMQ does not refuse a connection: a server that is not there is a health request unanswered


def check_reachable(config: Config) -> None:
    problems = [*env_server_problems(config), *verifiers_server_problems(config), *vllm_server_problems(config)]
    if problems:
        raise RefusedError("; ".join(problems))


def env_server_problems(config: Config) -> list[str]:
    problems = []
    for index, env in enumerate(config.env):
        if env.algorithm_server is None:
            continue
        where = f"env.{index}.server = {env.server!r}"
        try:
            response = httpx.get(env.server.rstrip("/") + "/health", headers=auth_headers(config.remote),
                                 timeout=TIMEOUT_S)
        except httpx.HTTPError as exc:
            problems.append(f"{where} does not answer ({type(exc).__name__}: {exc}); start it (trace-rl env-server "
                            f"--allow MODULE) or fix env.{index}.server")
            continue
        if response.status_code == 401:
            problems.append(f"{where} refused the token (HTTP 401): set {config.remote.token_env} to one of the "
                            "server's tokens")
        elif response.status_code != 200:
            problems.append(f"{where} answered /health with HTTP {response.status_code}; is it a trace-rl env "
                            f"server? fix env.{index}.server")
    return problems


def verifiers_server_problems(config: Config) -> list[str]:
    envs = [(f"env.{i}", env) for i, env in enumerate(config.env)]
    envs += [(f"eval.envs.{i}", env) for i, env in enumerate(config.eval.envs)] if config.eval is not None else []
    problems = []
    for where, env in envs:
        if env.verifiers_server is not None and not asyncio.run(verifiers_server_answers(env.verifiers_server)):
            problems.append(f"{where}.server = {env.server!r}: no verifiers env server answers there in "
                            f"{VERIFIERS_TIMEOUT_S:g}s; start it (trace-rl verifiers-env-server) or fix {where}.server")
    return problems


async def verifiers_server_answers(address: str) -> bool:
    from verifiers.v1.serve import EnvClient

    client = EnvClient(address)
    try:
        return await client.health(timeout=VERIFIERS_TIMEOUT_S)
    finally:
        await client.close()


def vllm_server_problems(config: Config) -> list[str]:
    urls = [("inference.base_url", config.inference.base_url)]
    for key, model in config.models.items():
        listed = [model.base_url] if isinstance(model.base_url, str) else list(model.base_url or [])
        urls += [(f"models.{key}.base_url", url) for url in listed]
    problems = []
    for where, url in urls:
        if not url:
            continue
        try:
            httpx.get(url.rstrip("/") + "/v1/models", timeout=TIMEOUT_S).raise_for_status()
        except httpx.HTTPError as exc:
            problems.append(f"{where} = {url!r} does not answer /v1/models ({type(exc).__name__}: {exc}); start the "
                            f"vLLM server or fix {where}")
    return problems
