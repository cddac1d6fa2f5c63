"""Building a model runtime from its config: a vLLM server, an in-process vLLM engine or transformers model,
and the runtimes that wrap no engine of their own (a tokenless model, the base model under a LoRA policy)."""

from __future__ import annotations

from typing import Any

import numpy as np

from trace_rl.models.runtime import Generation, ModelRuntime, RuntimeConfig


class TokenlessRuntime:
    """A model declared with `tokens = false`: it has a key and config but cannot sample or score tokens."""

    num_endpoints = 1
    tokenizer = None
    policy_step = 0
    holds_its_weights = True

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


class BaseModelView:
    """The base model under a LoRA runtime's adapter: the same engine (or server, or transformers model) and
    weights, every request made without the adapter. What `[models.<key>]` naming the policy's base model
    (a reference, an opd teacher) gets when the policy trains LoRA adapters."""

    policy_step = 0
    holds_its_weights = True

    def __init__(self, config: RuntimeConfig, lora_runtime: ModelRuntime):
        self.key = config.key
        self.config = config
        self.lora_runtime = lora_runtime
        self.tokenizer = lora_runtime.tokenizer

    @property
    def num_endpoints(self) -> int:
        return self.lora_runtime.num_endpoints

    async def generate(self, prompt_ids: list[int], **options: Any) -> Generation:
        return await self.lora_runtime.generate(prompt_ids, adapter=False, **options)

    async def score(self, token_ids: list[int], **options: Any) -> np.ndarray:
        return await self.lora_runtime.score(token_ids, adapter=False, **options)

    async def load_weights(self, local_dir: str, version: int) -> None:
        raise TypeError(f"model {self.key!r} is the base model of the LoRA-trained {self.config.base_of!r}: it keeps "
                        "the base weights, so it takes no broadcast")


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
