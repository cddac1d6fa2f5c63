"""The servers a run needs, checked before step 1 and before any engine starts: every env server answers `/health`
with the token, and every vLLM server answers (its storage is checked by `trace_rl.runs.start.check_run`).

A failure is one RefusedError naming the key and the fix, instead of a step that fails minutes later.
"""

from __future__ import annotations

import httpx

from trace_rl.config import Config
from trace_rl.errors import RefusedError
from trace_rl.remote.client import auth_headers

TIMEOUT_S = 10.0


def check_reachable(config: Config) -> None:
    problems = [*env_server_problems(config), *vllm_server_problems(config)]
    if problems:
        raise RefusedError("; ".join(problems))


def env_server_problems(config: Config) -> list[str]:
    problems = []
    for index, env in enumerate(config.env):
        if env.server is None:
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
