"""The `vllm` sampler over running vLLM OpenAI-compatible servers (`base_url`).

Requests go to `/v1/completions` with token-id prompts: `return_token_ids` gives the
sampled ids exactly (never re-tokenized text) and `logprobs = 0` the sampled tokens'
logprobs, which are the processed ones when the server runs with
`--logprobs-mode processed_logprobs`. Scoring uses `prompt_logprobs` with
`max_tokens = 1`. Several URLs are used round-robin for generation; `score` takes an
explicit endpoint so callers can spread scoring. Weight reloads use the server's
dev-mode routes (`VLLM_SERVER_DEV_MODE=1`): pause, `collective_rpc` of the reload
method of `trace_rl.inference.vllm_worker` (start the server with its
`--worker-extension-cls`), reset the prefix cache, resume; the weights directory must be
readable by the server at the same path. Every request pins the sampling knobs the
trainer does not model (top_k, min_p, penalties) to neutral values and names its stop
tokens, so a server's `--generation-config` defaults change nothing. A LoRA policy's adapters
go through `/v1/load_lora_adapter` (see `load_weights`).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Sequence

import httpx
import numpy as np

from trace_rl.inference.vllm_engine import check_full_distribution_scoring, prompt_logprobs_at
from trace_rl.inference.vllm_worker import RELOAD_METHOD
from trace_rl.inference.weights import check_weights, local_tensor_shapes
from trace_rl.models.hub import resolve_model_path
from trace_rl.models.lora import check_adapter, is_adapter_dir, vllm_max_lora_rank
from trace_rl.models.runtime import NEUTRAL_SAMPLING, Generation, RuntimeConfig, load_tokenizer, stop_token_ids


class ServerError(RuntimeError):
    """A vLLM server answered with an error (the message names the URL and its reply)."""


class VLLMServerRuntime:
    """A `ModelRuntime` over one or more vLLM servers serving the same model."""

    holds_its_weights = True  # nothing else in this process loads weights into its servers

    def __init__(self, config: RuntimeConfig):
        if not config.base_urls:
            raise ValueError(f"model {config.key!r}: a vLLM server runtime needs base_url")
        self.key = config.key
        self.config = config
        self.policy_step = 0
        self.base_urls = [url.rstrip("/").removesuffix("/v1") for url in config.base_urls]
        model_path = resolve_model_path(config.name, config.revision)
        self.tokenizer = load_tokenizer(model_path)
        self.stop_token_ids = stop_token_ids(self.tokenizer, config.stop_tokens, config.key)
        self._expected = local_tensor_shapes(model_path)
        self._next_endpoint = itertools.cycle(range(len(self.base_urls)))
        self._served_names: dict[str, str] = {}
        self._timeout = httpx.Timeout(config.request_timeout_s)
        self.adapter: str | None = None  # with [model.lora]: the name of the adapter requests name as their model

    @property
    def num_endpoints(self) -> int:
        return len(self.base_urls)

    async def _post(self, base_url: str, route: str, payload: dict | None = None, params: dict | None = None):
        async with httpx.AsyncClient(timeout=self._timeout) as client:
            response = await client.post(f"{base_url}{route}", json=payload, params=params)
        if response.status_code >= 400:
            raise ServerError(f"{base_url}{route} answered {response.status_code}: {response.text[:500]}")
        # the LoRA routes answer in plain text
        return response.json() if response.headers.get("content-type", "").startswith("application/json") else None

    async def _served_name(self, base_url: str) -> str:
        if base_url not in self._served_names:
            async with httpx.AsyncClient(timeout=self._timeout) as client:
                response = await client.get(f"{base_url}/v1/models")
            response.raise_for_status()
            self._served_names[base_url] = response.json()["data"][0]["id"]
        return self._served_names[base_url]

    async def next_endpoint(self) -> tuple[str, str]:
        """The next server (round-robin) and the model its requests name (the LoRA adapter when one is loaded), for
        a client that samples from it itself (a verifiers env server)."""
        base_url = self.base_urls[next(self._next_endpoint)]
        return base_url, self.adapter or await self._served_name(base_url)

    async def _complete(self, base_url: str, adapter: bool, **fields) -> dict:
        model = self.adapter if adapter and self.adapter else await self._served_name(base_url)
        payload = {"model": model, **fields}
        return (await self._post(base_url, "/v1/completions", payload))["choices"][0]

    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float = 1.0, seed: int = 0,
        stop: Sequence[str] = (), adapter: bool = True,
    ) -> Generation:
        """Sample a completion; `adapter=False` samples the base model under a loaded LoRA adapter."""
        choice = await self._complete(
            self.base_urls[next(self._next_endpoint)], adapter,
            prompt=list(prompt_ids), max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
            logprobs=0, return_token_ids=True, **NEUTRAL_SAMPLING,
            stop=list(stop), stop_token_ids=self.stop_token_ids, ignore_eos=True,
        )
        return Generation(
            token_ids=list(choice["token_ids"]),
            logprobs=list(choice["logprobs"]["token_logprobs"]),
            finish_reason=choice.get("finish_reason") or "length",
        )

    async def score(
        self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0, adapter: bool = True
    ) -> np.ndarray:
        """Per-token logprobs (the first 0); see `VLLMEngineRuntime.score` for temperatures other than 1."""
        if temperature != 1.0:
            check_full_distribution_scoring(self.key, len(self.tokenizer), temperature)
        choice = await self._complete(
            self.base_urls[endpoint % len(self.base_urls)], adapter,
            prompt=list(token_ids), max_tokens=1, temperature=1.0,
            prompt_logprobs=0 if temperature == 1.0 else -1, return_token_ids=True,
        )
        positions = [{int(t): lp["logprob"] for t, lp in entry.items()} for entry in choice["prompt_logprobs"][1:]]
        return prompt_logprobs_at(token_ids, positions, temperature)

    async def load_weights(self, local_dir: str, version: int) -> None:
        """On every endpoint: pause (letting in-flight requests finish on the old weights),
        check the new weights, reload, and resume, which always runs.

        A peft adapter directory (a LoRA run's `weights/<step>/`) is loaded instead through
        `/v1/load_lora_adapter` under a new name, which later requests name as their model,
        and the previous adapter is unloaded (the server runs with `--enable-lora` and
        `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`). Full weights drop the adapter."""
        if is_adapter_dir(local_dir):
            if self.config.lora is None:
                raise ValueError(f"{local_dir} holds a LoRA adapter, but model {self.key!r} has no [model.lora]")
            check_adapter(local_dir, vllm_max_lora_rank(self.config.lora.rank))
            new = f"{self.key}-step-{version}-{uuid.uuid4().hex[:8]}"
            await asyncio.gather(*(self._post(url, "/v1/load_lora_adapter", {"lora_name": new, "lora_path": local_dir})
                                   for url in self.base_urls))
        else:
            await asyncio.gather(*(self._reload_endpoint(url, local_dir) for url in self.base_urls))
            new = None
        old, self.adapter = self.adapter, new
        if old is not None:
            await asyncio.gather(*(self._post(url, "/v1/unload_lora_adapter", {"lora_name": old})
                                   for url in self.base_urls))
        self.policy_step = version

    async def _reload_endpoint(self, base_url: str, local_dir: str) -> None:
        await self._post(base_url, "/pause", params={"mode": "wait"})
        try:
            check_weights(local_dir, self._expected)
            payload = {"method": RELOAD_METHOD, "kwargs": {"weights_path": local_dir}}
            await self._post(base_url, "/collective_rpc", payload)
            await self._post(base_url, "/reset_prefix_cache")  # cached KV was computed with the old weights
        finally:
            await self._post(base_url, "/resume")
