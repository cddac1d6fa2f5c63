"""The `hf` sampler: a transformers model in this process (on CUDA when present), for machines without vLLM.

Outputs match the vLLM sampler's: sampled token ids and their *processed* logprobs,
log_softmax(logits / temperature) after top-p filtering, the same quantity the trainer
computes for the sampled tokens. Requests from all rollouts are batched (`RequestBatcher`) and
decoded together in a worker thread (`decode_batch`), so the event loop never blocks and every
turn that is ready goes out in the same batch; each request samples from its own seeded
generator, so the same seed gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import numpy as np
import torch

from trace_rl.hub import resolve_model_path
from trace_rl.inference.batcher import RequestBatcher
from trace_rl.inference.hf_decode import Request, decode_batch
from trace_rl.inference.weights import check_weights, safetensors_files
from trace_rl.models import Generation, RuntimeConfig, load_tokenizer, stop_token_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFRuntime:
    """A `ModelRuntime` over a transformers causal LM loaded in this process."""

    num_endpoints = 1

    def __init__(self, config: RuntimeConfig):
        from transformers import AutoModelForCausalLM

        self.key = config.key
        self.config = config
        self.policy_version = 0
        path = resolve_model_path(config.name, config.revision)
        self.tokenizer = load_tokenizer(path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[config.dtype]).to(self.device)
        self.model.eval()
        self.stop_token_ids = stop_token_ids(self.tokenizer, config.stop_tokens, config.key)
        self._lock = threading.Lock()  # weights change only between batches and scores
        self._batcher = RequestBatcher(self._decode, name=f"hf-sampler-{config.key}")

    # -- sampling ---------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float = 1.0, seed: int = 0
    ) -> Generation:
        request = Request(list(prompt_ids), temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
        return await asyncio.wrap_future(self._batcher.submit(request))

    def _decode(self, requests: list[Request], futures: list[Future]) -> None:
        pad = self.tokenizer.pad_token_id
        with self._lock:
            generations = decode_batch(self.model, requests, stop_ids=self.stop_token_ids,
                                       pad_id=pad if pad is not None else self.stop_token_ids[0])
        # all at once, in request order: the turns that follow start together and form the next batch,
        # the same one on every run
        for future, generation in zip(futures, generations, strict=True):
            future.set_result(generation)

    # -- scoring ----------------------------------------------------------------------
    async def score(self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0) -> np.ndarray:
        return await asyncio.to_thread(self._score, list(token_ids), temperature)

    def _score(self, token_ids: list[int], temperature: float) -> np.ndarray:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with self._lock, torch.no_grad():
            logits = self.model(input_ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, input_ids[0, 1:, None])[:, 0]
        return np.concatenate([[0.0], logprobs.cpu().numpy()]).astype(np.float32)

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
