"""A tiny Qwen2 model with a byte-level tokenizer and a ChatML template, built offline.

`model.name = "tiny"` (or `"tiny:<seed>"`) builds it on first use into the cache
directory (`$TRACE_RL_CACHE`, default `~/.cache/trace-rl`), deterministically from
the seed, as a normal Hugging Face directory that transformers and vLLM load as-is.
One token per byte keeps string tasks (reverse, sort) learnable by a tiny model;
head_dim is 32 because vLLM's CPU attention needs at least that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- message['content'] }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>' + call['name'] + ' ' + (call['arguments'] | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{%- else %}{{- message['content'] }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ARCHITECTURE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY_VERSION = 1


def parse_tiny(name: str) -> int | None:
    """The seed of a tiny-model name (`tiny` -> 0, `tiny:7` -> 7); None for any other name."""
    if name == "tiny":
        return 0
    if name.startswith("tiny:") and name[5:].isdigit():
        return int(name[5:])
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("TRACE_RL_CACHE", Path.home() / ".cache" / "trace-rl"))


def tiny_vocabulary() -> set[str]:
    """Every token of the tiny tokenizer: one per byte (byte-level characters) plus the special tokens."""
    from tokenizers import pre_tokenizers

    return set(pre_tokenizers.ByteLevel.alphabet()) | set(SPECIAL_TOKENS)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny(seed: int = 0) -> Path:
    """Build (once) and return the directory of the tiny model for `seed`."""
    spec = json.dumps({"version": TINY_VERSION, "seed": seed, **ARCHITECTURE}, sort_keys=True)
    target = cache_dir() / f"tiny-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    vocab_size = 64 * ((len(tokenizer) + 63) // 64)
    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **ARCHITECTURE,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target) if not target.exists() else shutil.rmtree(staging)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
