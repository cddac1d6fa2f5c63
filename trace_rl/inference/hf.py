"""The `hf` sampler: a transformers model in this process, for machines without vLLM.

Outputs match the vLLM sampler's: sampled token ids and their *processed* logprobs,
log_softmax(logits / temperature) after top-p filtering, the same quantity the trainer
computes for the sampled tokens. Model calls run in a worker thread behind one lock, so
many async rollouts can share the runtime without blocking the event loop; each request
samples from its own seeded RNG, so the same seed gives the same tokens on CPU.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch

from trace_rl.inference.weights import check_weights, safetensors_files
from trace_rl.models import (NEUTRAL_SAMPLING, TORCH_STATE_LOCK, Generation, RuntimeConfig, load_tokenizer,
                             stop_token_ids)
from trace_rl.hub import resolve_model_path

# transformers' names for the neutral values (top_k 0 and min_p 0 keep every token)
NEUTRAL_SAMPLING_HF = {"top_k": 0, "min_p": 0.0, "repetition_penalty": NEUTRAL_SAMPLING["repetition_penalty"],
                       "typical_p": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFRuntime:
    """A `ModelRuntime` over a transformers causal LM loaded in this process."""

    num_endpoints = 1

    def __init__(self, config: RuntimeConfig):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.key = config.key
        self.config = config
        self.policy_version = 0
        path = resolve_model_path(config.name, config.revision)
        self.tokenizer = load_tokenizer(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[config.dtype])
        self.model.eval()
        # the model's generation_config.json (top_k, repetition_penalty, ...) must not change what is sampled
        self.model.generation_config = GenerationConfig()
        self.stop_token_ids = stop_token_ids(self.tokenizer, config.stop_tokens, config.key)
        self.device = torch.device("cpu")
        self._lock = threading.Lock()

    # -- sampling ---------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float = 1.0, seed: int = 0
    ) -> Generation:
        return await asyncio.to_thread(self._generate, list(prompt_ids), temperature, max_tokens, top_p, seed)

    def _generate(self, prompt_ids: list[int], temperature: float, max_tokens: int, top_p: float, seed: int):
        stops = self.stop_token_ids
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        with self._lock, TORCH_STATE_LOCK, torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                **NEUTRAL_SAMPLING_HF,
                max_new_tokens=max_tokens,
                eos_token_id=stops,
                pad_token_id=pad if pad is not None else stops[0],
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt_ids) :]
        # `scores` are the processed logits (divided by temperature, top-p filtered to -inf)
        scores = torch.stack(out.scores, dim=1)[0].float()
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, tokens[:, None])[:, 0]
        token_ids = tokens.tolist()
        finish = "stop" if token_ids and token_ids[-1] in stops else "length"
        return Generation(token_ids=token_ids, logprobs=logprobs.tolist(), finish_reason=finish)

    # -- scoring ----------------------------------------------------------------------
    async def score(self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0) -> np.ndarray:
        return await asyncio.to_thread(self._score, list(token_ids), temperature)

    def _score(self, token_ids: list[int], temperature: float) -> np.ndarray:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with self._lock, torch.no_grad():
            logits = self.model(input_ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, input_ids[0, 1:, None])[:, 0]
        return np.concatenate([[0.0], logprobs.numpy()]).astype(np.float32)

    # -- weights ----------------------------------------------------------------------
    async def load_weights(self, local_dir: str, version: int) -> None:
        """Load a safetensors state dict; checked in full first, so a bad one changes nothing."""
        await asyncio.to_thread(self._load_weights, local_dir, version)

    def _load_weights(self, local_dir: str, version: int) -> None:
        from safetensors.torch import load_file

        current = self.model.state_dict()
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        check_weights(local_dir, {name: tuple(t.shape) for name, t in current.items()}, optional=tied)
        with self._lock, torch.no_grad():
            for path in safetensors_files(local_dir):
                for name, tensor in load_file(path).items():
                    current[name].copy_(tensor)
        self.policy_version = version
