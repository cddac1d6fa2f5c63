"""Model runtimes: what algorithms and environments call, by key (`policy`, `reference`, ...).

A runtime is built from a `RuntimeConfig`, plain data that can cross a process
boundary (the remote env server rebuilds runtimes from it). Token-capable runtimes
`generate` (token ids in, token ids + processed logprobs out) and `score` (token ids
in, per-token logprobs out, the first token 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from trace_rl.config import Config


class RuntimeConfig(BaseModel):
    """Everything needed to rebuild a model runtime in another process."""

    model_config = ConfigDict(extra="forbid")
    key: str
    name: str
    dtype: str = "float32"
    tokens: bool = True
    backend: Literal["hf", "vllm"] = "hf"
    base_urls: list[str] = []  # non-empty: a vLLM server (round-robin over the URLs), whatever `backend` says
    max_model_len: int = 1024
    max_num_batched_tokens: int | None = None
    seed: int = 0
    cpu_kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    request_timeout_s: float = 120.0
    reload_timeout_s: float = 600.0


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "length"


@runtime_checkable
class ModelRuntime(Protocol):
    key: str
    config: RuntimeConfig
    tokenizer: Any  # a transformers tokenizer (with the chat template), always local
    policy_version: int  # the trainer step whose weights it samples with (0: the initial weights)

    @property
    def num_endpoints(self) -> int:
        """Scoring endpoints that `score(endpoint=i)` spreads over (1 for in-process models)."""

    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float, seed: int
    ) -> Generation: ...

    async def score(self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0) -> np.ndarray: ...

    async def load_weights(self, local_dir: str, version: int) -> None:
        """Switch to the safetensors weights in `local_dir`; on failure the old weights stay."""


def load_tokenizer(model_path: str):
    """The model's transformers tokenizer (with its chat template), from a local directory or hub id."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def runtime_configs(config: Config) -> dict[str, RuntimeConfig]:
    """One RuntimeConfig per model key: `policy` from [model] + [inference], others from [models.<key>].

    An extra model named plain `tiny` gets its own seed (`seed`, default the run seed + 1),
    so a tiny reference differs from the tiny policy; the policy's name is kept verbatim,
    exactly as the trainer resolves it.
    """
    from trace_rl.config import POLICY

    inference = config.inference
    engine = {
        "backend": inference.backend,
        "max_model_len": inference.max_model_len,
        "max_num_batched_tokens": inference.max_num_batched_tokens,
        "cpu_kv_cache_gb": inference.cpu_kv_cache_gb,
        "gpu_memory_utilization": inference.gpu_memory_utilization,
        "enforce_eager": inference.enforce_eager,
        "request_timeout_s": inference.request_timeout_s,
        "reload_timeout_s": inference.reload_timeout_s,
        "seed": config.seed,
    }
    configs = {
        POLICY: RuntimeConfig(
            key=POLICY,
            name=config.model.name,
            dtype=config.model.dtype,
            base_urls=[inference.base_url] if inference.base_url else [],
            **engine,
        )
    }
    for key, model in config.models.items():
        seed = model.seed if model.seed is not None else config.seed + 1
        name = f"tiny:{seed}" if model.name == "tiny" else model.name
        urls = [model.base_url] if isinstance(model.base_url, str) else list(model.base_url or [])
        configs[key] = RuntimeConfig(
            key=key, name=name, dtype=model.dtype, tokens=model.tokens, base_urls=urls, **{**engine, "seed": seed}
        )
    return configs


class TokenlessRuntime:
    """A model declared with `tokens = false`: it has a key and config but cannot sample or score tokens."""

    num_endpoints = 1
    tokenizer = None
    policy_version = 0

    def __init__(self, config: RuntimeConfig):
        self.key = config.key
        self.config = config

    def _refuse(self, what: str) -> None:
        raise TypeError(
            f"model {self.key!r} is not token-capable, so it cannot {what}; "
            f"set tokens = true in [models.{self.key}] (needs a local tokenizer and a vLLM or hf backend)"
        )

    async def generate(self, prompt_ids: list[int], **_: Any) -> Generation:
        self._refuse("generate")

    async def score(self, token_ids: list[int], **_: Any) -> np.ndarray:
        self._refuse("score")

    async def load_weights(self, local_dir: str, version: int) -> None:
        self._refuse("load weights")


def build_runtime(config: RuntimeConfig) -> ModelRuntime:
    """The runtime for a config: vLLM server (base_urls), in-process vLLM, or in-process transformers."""
    if not config.tokens:
        return TokenlessRuntime(config)
    if config.base_urls:
        from trace_rl.inference.vllm_server import VLLMServerRuntime

        return VLLMServerRuntime(config)
    if config.backend == "vllm":
        from trace_rl.inference.vllm_engine import VLLMEngineRuntime

        return VLLMEngineRuntime(config)
    from trace_rl.inference.hf import HFRuntime

    return HFRuntime(config)
