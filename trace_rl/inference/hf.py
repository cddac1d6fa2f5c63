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
import contextlib
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch

from trace_rl.inference.batcher import RequestBatcher
from trace_rl.inference.hf_decode import Request, decode_batch
from trace_rl.inference.weights import check_weights, safetensors_files
from trace_rl.models.float32_head import use_float32_head
from trace_rl.models.hub import resolve_model_path
from trace_rl.models.lora import ADAPTER_WEIGHTS, check_adapter, is_adapter_dir
from trace_rl.models.rms_norm import use_one_rounding_norms
from trace_rl.models.runtime import Generation, RuntimeConfig, load_tokenizer, stop_token_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def row_key(request: Request) -> tuple:
    """Where a request goes in its batch: by what it asks, not when it arrived. A CPU GEMM can round a row
    differently at another position in the batch (seen on a Zen 5), and requests that wait on I/O (a sandbox
    starting) arrive in another order on each run: so the same requests fill the same rows on every run."""
    return request.seed, request.prompt_ids, request.temperature, request.top_p, request.max_tokens, request.stop


class HFRuntime:
    """A `ModelRuntime` over a transformers causal LM loaded in this process."""

    num_endpoints = 1
    holds_its_weights = True  # the model is this runtime's own

    def __init__(self, config: RuntimeConfig):
        from transformers import AutoModelForCausalLM

        self.key = config.key
        self.config = config
        self.policy_step = 0
        path = resolve_model_path(config.name, config.revision)
        self.tokenizer = load_tokenizer(path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[config.dtype])
        self.peft = None
        self.adapter_loaded = False
        if config.lora is not None:
            from peft import get_peft_model

            from trace_rl.models.lora import peft_config

            # the adapter's layers go into the model in place; until an adapter is loaded they are switched off
            self.peft = get_peft_model(self.model, peft_config(config.lora))
            self.model = self.peft.get_base_model()
        self.model.to(self.device)
        self.model.eval()
        use_float32_head(self.model)  # the trainer's logits: float32 from the half-precision hidden states
        use_one_rounding_norms(self.model, DTYPES[config.dtype])  # the trainer's norms, and vLLM's
        self.stop_token_ids = stop_token_ids(self.tokenizer, config.stop_tokens, config.key)
        self._lock = threading.Lock()  # weights change only between batches and scores
        self._batcher = RequestBatcher(self._decode, name=f"hf-sampler-{config.key}")

    # -- sampling ---------------------------------------------------------------------
    def _adapter(self, adapter: bool):
        """The LoRA adapter on (when asked for and one is loaded) or off, for one call under the lock."""
        if self.peft is None or (adapter and self.adapter_loaded):
            return contextlib.nullcontext()
        return self.peft.disable_adapter()

    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float = 1.0, seed: int = 0,
        stop: Sequence[str] = (), adapter: bool = True,
    ) -> Generation:
        """Sample a completion; `adapter=False` samples the base model under a loaded LoRA adapter."""
        request = Request(list(prompt_ids), temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                          adapter=adapter, stop=tuple(stop))
        return await asyncio.wrap_future(self._batcher.submit(request))

    def _decode(self, requests: list[Request], futures: list[Future]) -> None:
        pad = self.tokenizer.pad_token_id
        generations: dict[int, Generation] = {}
        for adapter in (True, False):  # one batch with the LoRA adapter on, one with it off
            rows = sorted((i for i, request in enumerate(requests) if request.adapter == adapter),
                          key=lambda i: row_key(requests[i]))
            if rows:
                with self._lock, self._adapter(adapter):
                    decoded = decode_batch(self.model, [requests[i] for i in rows], stop_ids=self.stop_token_ids,
                                           pad_id=pad if pad is not None else self.stop_token_ids[0],
                                           decode=self._text)
                generations.update(zip(rows, decoded))
        # all at once, in request order: the turns that follow start together and form the next batch,
        # the same one on every run
        for index, future in enumerate(futures):
            future.set_result(generations[index])

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # -- scoring ----------------------------------------------------------------------
    async def score(
        self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0, adapter: bool = True
    ) -> np.ndarray:
        return await asyncio.to_thread(self._score, list(token_ids), temperature, adapter)

    def _score(self, token_ids: list[int], temperature: float, adapter: bool) -> np.ndarray:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with self._lock, self._adapter(adapter), torch.no_grad():
            logits = self.model(input_ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, input_ids[0, 1:, None])[:, 0]
        return np.concatenate([[0.0], logprobs.cpu().numpy()]).astype(np.float32)

    # -- weights ----------------------------------------------------------------------
    async def load_weights(self, local_dir: str, version: int) -> None:
        """Load a safetensors state dict; checked in full first, so a bad one changes nothing.

        A peft adapter directory (a LoRA run's `weights/<step>/`) is copied into the adapter's
        layers and switches them on; full weights (the base model at step 0) switch them off."""
        await asyncio.to_thread(self._load_weights, local_dir, version)

    def _load_weights(self, local_dir: str, version: int) -> None:
        from safetensors.torch import load_file

        if is_adapter_dir(local_dir):
            self._load_adapter(local_dir)
        else:
            # with LoRA layers in place a base Linear's weight is `<name>.base_layer.weight`; adapters stay out
            current = {name.replace(".base_layer.", "."): tensor for name, tensor in self.model.state_dict().items()
                       if ".lora_" not in name}
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            check_weights(local_dir, {name: tuple(t.shape) for name, t in current.items()}, optional=tied)
            with self._lock, torch.no_grad():
                for path in safetensors_files(local_dir):
                    for name, tensor in load_file(path).items():
                        current[name].copy_(tensor)
                self.adapter_loaded = False
        self.policy_step = version

    def _load_adapter(self, local_dir: str) -> None:
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        if self.peft is None:
            raise ValueError(f"{local_dir} holds a LoRA adapter, but model {self.key!r} has no [model.lora]")
        check_adapter(local_dir, self.config.lora.rank)
        expected = {name: tuple(t.shape) for name, t in get_peft_model_state_dict(self.peft).items()}
        tensors = load_file(os.path.join(local_dir, ADAPTER_WEIGHTS))
        found = {name: tuple(t.shape) for name, t in tensors.items()}
        if found != expected:
            raise ValueError(f"the adapter in {local_dir} does not fit model {self.key!r}'s [model.lora] "
                             f"(differing tensors: {sorted(set(found.items()) ^ set(expected.items()))[:4]})")
        with self._lock, torch.no_grad():
            set_peft_model_state_dict(self.peft, tensors)
            self.adapter_loaded = True
