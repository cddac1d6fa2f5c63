"""LoRA adapters of the policy (`[model.lora]`, docs/lora.md): the peft config, adapter directories, and the
config-time checks.

A LoRA layer adds a low-rank update to a frozen Linear W (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models"):

    h = W x + (alpha / r) * B A x,    A: r x d_in,  B: d_out x r,  B = 0 at the start

so only A and B train, and `weights/<step>/` holds just them, as a peft adapter directory (`adapter_config.json`
plus `adapter_model.safetensors`). Importing this module stays cheap (no torch, no peft) for `--dry-run`.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trace_rl.config import Config, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# the ranks vLLM can serve (its `max_lora_rank` takes one of these): an adapter's rank is rounded up to one
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
BLOCK_PART = re.compile(r"\.\d+\.")


def is_adapter_dir(local_dir: str | os.PathLike) -> bool:
    """Whether a weights directory holds a peft adapter (else: full Hugging Face weights)."""
    return (Path(local_dir) / ADAPTER_CONFIG).is_file()


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that fits an adapter of rank `rank`."""
    fitting = [r for r in VLLM_MAX_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"model.lora.rank = {rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANKS[-1]}")
    return fitting[0]


def peft_config(lora: LoraConfig):
    """The peft `LoraConfig` of `[model.lora]` (a causal LM; the adapter's bias is none, as vLLM serves it)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")


def safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, ...} from a safetensors file's JSON header (8-byte length, then the JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def block_linear_names(model_dir: str | os.PathLike) -> set[str]:
    """The names a LoRA target can take in a model: the last part of every 2-D `.weight` inside the repeated
    decoder blocks (`model.layers.<i>.`), read from its safetensors headers (no weights loaded)."""
    names = set()
    for path in Path(model_dir).glob("*.safetensors"):
        for tensor, info in safetensors_header(path).items():
            if tensor.endswith(".weight") and len(info["shape"]) == 2 and BLOCK_PART.search(tensor):
                names.add(tensor.removesuffix(".weight").rsplit(".", 1)[-1])
    return names


def check_lora(config: Config) -> list[str]:
    """Config-time check of `[model.lora]`: a rank vLLM can serve, and target modules the model has.

    The model's Linear names come from its safetensors headers (a local directory, or a Hub id already in
    the cache); `tiny` is a Qwen2 with the default targets. A model not on disk yet is checked by peft when
    the trainer loads it."""
    from trace_rl.config import DEFAULT_LORA_TARGETS
    from trace_rl.models.hub import local_model_dir
    from trace_rl.models.tiny import parse_tiny

    lora = config.model.lora
    if lora is None:
        return []
    problems = []
    if config.inference.backend == "vllm" and lora.rank > VLLM_MAX_LORA_RANKS[-1]:
        problems.append(f"model.lora.rank = {lora.rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANKS[-1]}; "
                        "lower it")
    if parse_tiny(config.model.name) is not None:
        known = set(DEFAULT_LORA_TARGETS)
    else:
        directory = local_model_dir(config.model.name, config.model.revision)
        known = block_linear_names(directory) if directory is not None else None
    if known:
        unknown = [name for name in lora.target_modules if name not in known]
        if unknown:
            problems.append(f"model.lora.target_modules: {', '.join(map(repr, unknown))} "
                            f"{'is not a Linear' if len(unknown) == 1 else 'are not Linears'} of "
                            f"{config.model.name}'s decoder blocks; use some of: {', '.join(sorted(known))}")
    return problems


def check_adapter(local_dir: str | os.PathLike, max_rank: int) -> dict:
    """The adapter's config, once checked to be a peft LoRA adapter a sampler with `max_rank` can load (a vLLM
    engine that fails to load one dies with it, so this runs first); raises naming the directory otherwise."""
    directory = Path(local_dir)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{directory} holds a {config.get('peft_type')} adapter; only LoRA adapters load")
    if int(config["r"]) > max_rank:
        raise ValueError(f"the adapter in {directory} has rank {config['r']}, above the {max_rank} the sampler serves")
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file() or not any(".lora_A." in name for name in safetensors_header(weights)):
        raise ValueError(f"{directory} has no LoRA tensors in {ADAPTER_WEIGHTS}")
    return config
