"""Model runtimes' types and configs: what algorithms and environments call, by key (`policy`, `reference`, ...).

A runtime is built from a `RuntimeConfig` (`trace_rl.inference.build.build_runtime`), plain data
that can cross a process boundary (the remote env server rebuilds runtimes from it). Token-capable
runtimes `generate` (token ids in, token ids + processed logprobs out) and `score` (token ids in,
per-token logprobs out, the first token 0). `runtime_configs` gives a run's configs, one per model key.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict

from trace_rl.config import LoraConfig

if TYPE_CHECKING:
    from trace_rl.config import Config

# The process's global torch state: its RNG (a trainer seeds and restores it as it is built; the hf sampler draws
# from per-request generators only) and the defaults transformers switches while it builds a model (meta device,
# init flags). With `[async]` sampling runs beside training in another thread; building a runtime or a trainer
# holds this lock, so neither thread moves the other's state.
TORCH_STATE_LOCK = threading.Lock()


class RuntimeConfig(BaseModel):
    """Everything needed to rebuild a model runtime in another process."""

    model_config = ConfigDict(extra="forbid")
    key: str
    name: str
    revision: str | None = None  # of a Hub id: every process resolves `name` to the same snapshot
    dtype: str = "float32"
    tokens: bool = True
    backend: Literal["hf", "vllm"] = "hf"
    base_urls: list[str] = []  # non-empty: a vLLM server (round-robin over the URLs), whatever `backend` says
    max_model_len: int = 1024
    max_num_batched_tokens: int | None = None
    seed: int = 0
    cpu_kv_cache_gb: float | None = None  # None: sized to `step_sequences` x `max_model_len` (vllm_engine)
    step_sequences: int = 64  # sequences a step keeps in the engine at once (its rollouts in flight)
    gpu_memory_utilization: float = 0.5  # this engine's share of the GPU (trace_rl.pipeline.colocation.memory_shares)
    sleep_mode: bool = False  # start vLLM with sleep mode: it sleeps while a colocated trainer runs (GPU only)
    samples_beside_training: bool = False  # the trainer computes while it samples ([async] max_off_policy_steps >= 1)
    enforce_eager: bool = True
    request_timeout_s: float = 120.0
    stop_tokens: list[str] | None = None  # None: the tokenizer's eos token
    reload_timeout_s: float = 600.0
    lora: LoraConfig | None = None  # the policy's [model.lora]: it loads the adapters the trainer exports
    base_of: str | None = None  # a LoRA runtime's key whose base model this is: served by it, without the adapter


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
    policy_step: int  # the trainer step whose weights it samples with (0: the initial weights)
    # False once another runtime replaced the weights it loaded last (an in-process vLLM engine is shared by every
    # session of the process); True where nothing else in this process loads into its model
    holds_its_weights: bool

    @property
    def num_endpoints(self) -> int:
        """Scoring endpoints that `score(endpoint=i)` spreads over (1 for in-process models)."""

    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float, seed: int,
        stop: Sequence[str] = (),
    ) -> Generation:
        """Sample one turn: it ends at a stop token, at the token that completes one of the `stop` strings
        (kept), or after `max_tokens`."""

    async def score(self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0) -> np.ndarray: ...

    async def load_weights(self, local_dir: str, version: int) -> None:
        """Switch to the safetensors weights in `local_dir`; on failure the old weights stay."""


# Every sampler sets these on every request, whatever the model's generation_config.json says:
# the trainer computes log_softmax(logits / T) of the sampled token, so the sampler must sample
# from exactly that distribution (top_p is the one truncation allowed, and only for actors the
# trainer does not train; see docs/models.md).
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}


class StopTokenError(ValueError):
    """A configured stop token that is not one token of the model's tokenizer."""


def stop_token_ids(tokenizer, stop_tokens: list[str] | None, key: str = "model") -> list[int]:
    """The token ids that end a model turn: `stop_tokens` (each one token of the vocabulary), else the eos token."""
    names = stop_tokens or [tokenizer.eos_token]
    ids = []
    for name in names:
        token_id = tokenizer.convert_tokens_to_ids(name)
        if token_id is None or (token_id == tokenizer.unk_token_id and name != tokenizer.unk_token):
            raise StopTokenError(f"{key}.stop_tokens: {name!r} is not a token of the model's tokenizer; "
                                 "list end-of-turn tokens as they appear in its vocabulary, e.g. '<|im_end|>'")
        ids.append(int(token_id))
    return ids


def check_stop_tokens(config: Config) -> list[str]:
    """Config-time check (no torch): every `stop_tokens` entry is one token of its model's tokenizer.

    Reads `tokenizer.json` with `tokenizers` for a local directory or a Hub id already in the cache; for
    `tiny` the vocabulary is its byte alphabet and special tokens. Models not on disk yet are checked when
    they load."""
    from trace_rl.models.hub import local_model_dir
    from trace_rl.models.tiny import parse_tiny, tiny_vocabulary

    models = [("model", config.model), *((f"models.{key}", m) for key, m in config.models.items())]
    problems = []
    for where, model in models:
        if not model.stop_tokens:
            continue
        if parse_tiny(model.name) is not None:
            vocabulary = tiny_vocabulary()
            known = lambda token: token in vocabulary  # noqa: E731
        else:
            directory = local_model_dir(model.name, model.revision)
            if directory is None or not (directory / "tokenizer.json").is_file():
                continue
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            known = lambda token: tokenizer.token_to_id(token) is not None  # noqa: E731
        problems += [f"{where}.stop_tokens: {token!r} is not a token of {model.name}'s tokenizer; list end-of-turn "
                     "tokens as they appear in its vocabulary, e.g. '<|im_end|>'"
                     for token in model.stop_tokens if not known(token)]
    return problems


def load_tokenizer(model_path: str):
    """The model's transformers tokenizer (with its chat template), from a local directory or hub id."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
