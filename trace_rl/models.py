"""Model runtimes: what algorithms and environments call, by key (`policy`, `reference`, ...).

A runtime is built from a `RuntimeConfig`, plain data that can cross a process
boundary (the remote env server rebuilds runtimes from it). Token-capable runtimes
`generate` (token ids in, token ids + processed logprobs out) and `score` (token ids
in, per-token logprobs out, the first token 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict


class RuntimeConfig(BaseModel):
    """Everything needed to rebuild a model runtime in another process."""

    model_config = ConfigDict(extra="forbid")
    key: str
    name: str
    dtype: str = "float32"
    tokens: bool = True
    backend: str = "hf"
    base_urls: list[str] = []
    max_model_len: int = 1024
    seed: int = 0


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

    @property
    def num_endpoints(self) -> int:
        """Scoring endpoints that `score(endpoint=i)` spreads over (1 for in-process models)."""

    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float, seed: int
    ) -> Generation: ...

    async def score(self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0) -> np.ndarray: ...
