"""The `vllm` sampler in this process: one engine per model, started once and reused.

The engine is vLLM's synchronous `LLMEngine`, owned by one worker thread that runs
continuous batching: it adds every queued request, steps the engine, and resolves each
request's future when it finishes. Async callers await those futures from any event
loop, so rollouts of many steps (each maybe under its own `asyncio.run`) share one
engine. (vLLM's `AsyncLLM` binds its output handler to the loop it first ran on, which
breaks when a later step runs a new loop.) Weight reloads run on the same thread
between engine steps, so no forward pass sees half-loaded weights; a request still in
flight continues on the new weights, so broadcast between rollout steps.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from trace_rl.inference.vllm_worker import EXTENSION, RELOAD_METHOD
from trace_rl.inference.weights import check_weights, local_tensor_shapes
from trace_rl.models import Generation, RuntimeConfig, load_tokenizer
from trace_rl.tiny import resolve_model_path


class EngineWorker:
    """A vLLM engine driven by a dedicated thread; submit requests or calls, get futures back."""

    def __init__(self, config: RuntimeConfig):
        self.model_path = resolve_model_path(config.name)
        self._config = config
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, Future] = {}
        self._ids = itertools.count()
        self._started: Future = Future()
        self._thread = threading.Thread(target=self._run, name=f"vllm-engine-{config.key}", daemon=True)
        self._thread.start()
        self.llm = self._started.result()

    def _start_engine(self):
        from vllm import LLM
        from vllm.platforms import current_platform

        config = self._config
        if current_platform.is_cpu():
            # an explicit KV cache size; `gpu_memory_utilization` would reserve that fraction of all RAM
            memory = {"kv_cache_memory_bytes": int(config.cpu_kv_cache_gb * 2**30)}
        else:
            memory = {"gpu_memory_utilization": config.gpu_memory_utilization}
        return LLM(
            model=self.model_path,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,
            worker_extension_cls=EXTENSION,
            **memory,
        )

    def _run(self) -> None:
        try:
            llm = self._start_engine()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for the engine
            self._started.set_exception(exc)
            return
        self._started.set_result(llm)
        engine = llm.llm_engine
        while True:
            busy = engine.has_unfinished_requests()
            try:
                commands = [self._inbox.get(block=not busy)]
            except queue.Empty:
                commands = []
            while not self._inbox.empty():
                commands.append(self._inbox.get_nowait())
            for kind, payload, future in commands:
                if kind == "stop":
                    llm.llm_engine.engine_core.shutdown()
                    future.set_result(None)
                    return
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if kind == "request":
                        request_id, prompt_ids, params = payload
                        engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
                        self._pending[request_id] = future
                    else:
                        future.set_result(payload(llm))
                except Exception as exc:  # noqa: BLE001 - reported to the caller through its future
                    future.set_exception(exc)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001 - every waiting caller gets the engine's error
                    for pending in self._pending.values():
                        pending.set_exception(exc)
                    self._pending.clear()
                    continue
                for output in outputs:
                    if output.finished:
                        self._pending.pop(output.request_id).set_result(output)

    def submit(self, prompt_ids: list[int], params) -> Future:
        future: Future = Future()
        self._inbox.put(("request", (f"req-{next(self._ids)}", prompt_ids, params), future))
        return future

    def call(self, function: Callable[[Any], Any]) -> Future:
        """Run `function(llm)` on the engine thread between two engine steps."""
        future: Future = Future()
        self._inbox.put(("call", function, future))
        return future

    def stop(self) -> None:
        """Shut the engine down (its processes exit) and end the thread."""
        future: Future = Future()
        self._inbox.put(("stop", None, future))
        future.result()
        self._thread.join()


ENGINES: dict[tuple, EngineWorker] = {}
ENGINES_LOCK = threading.Lock()


def engine_for(config: RuntimeConfig) -> EngineWorker:
    """The process's engine for this runtime key and model (started on first use).

    Keyed by the runtime key too: a `reference` must keep its weights when `policy`,
    though the same model, receives a broadcast.
    """
    key = (config.key, config.name, config.dtype, config.max_model_len, config.enforce_eager, config.seed)
    with ENGINES_LOCK:
        if key not in ENGINES:
            ENGINES[key] = EngineWorker(config)
        return ENGINES[key]


def shutdown_engines() -> None:
    """Stop every engine of this process (they otherwise stop when the process exits)."""
    with ENGINES_LOCK:
        while ENGINES:
            ENGINES.popitem()[1].stop()


class VLLMEngineRuntime:
    """A `ModelRuntime` over the process's in-process vLLM engine for a model."""

    num_endpoints = 1

    def __init__(self, config: RuntimeConfig):
        self.key = config.key
        self.config = config
        self.policy_version = 0
        self.worker = engine_for(config)
        self.tokenizer = load_tokenizer(self.worker.model_path)
        self._expected = local_tensor_shapes(self.worker.model_path)

    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float = 1.0, seed: int = 0
    ) -> Generation:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed, logprobs=0, detokenize=False
        )
        output = (await asyncio.wrap_future(self.worker.submit(list(prompt_ids), params))).outputs[0]
        token_ids = list(output.token_ids)
        logprobs = [entry[token].logprob for token, entry in zip(token_ids, output.logprobs)]
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=output.finish_reason or "length")

    async def score(self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0) -> np.ndarray:
        """Per-token logprobs from vLLM's prompt logprobs (raw, i.e. at temperature 1).

        At another temperature it asks for the full distribution at each position and
        rescales it: log_softmax(raw_logprobs / T) = log_softmax(logits / T). That costs
        vocabulary-size work per token, fine for small vocabularies.
        """
        from vllm import SamplingParams

        full = temperature != 1.0
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1 if full else 0, detokenize=False)
        output = await asyncio.wrap_future(self.worker.submit(list(token_ids), params))
        positions = [{t: lp.logprob for t, lp in entry.items()} for entry in output.prompt_logprobs[1:]]
        return prompt_logprobs_at(token_ids, positions, temperature)

    async def load_weights(self, local_dir: str, version: int) -> None:
        """Check the new weights, then reload them in place between two engine steps."""
        check_weights(local_dir, self._expected)
        call = lambda llm: llm.collective_rpc(RELOAD_METHOD, kwargs={"weights_path": local_dir})  # noqa: E731
        await asyncio.wrap_future(self.worker.call(call))
        self.policy_version = version


def prompt_logprobs_at(token_ids: list[int], positions: list[dict[int, float]], temperature: float) -> np.ndarray:
    """The logprob of each token given the ones before it (the first 0) from prompt logprobs.

    `positions[i]` maps token id -> raw logprob at position i + 1: just the actual token at
    temperature 1, the whole vocabulary otherwise (rescaled: log_softmax(raw / T)).
    """
    out = np.zeros(len(token_ids), dtype=np.float32)
    if temperature == 1.0:
        out[1:] = [entry[token] for token, entry in zip(token_ids[1:], positions)]
        return out
    for position, (token, entry) in enumerate(zip(token_ids[1:], positions), start=1):
        scaled = np.fromiter(entry.values(), dtype=np.float64, count=len(entry)) / temperature
        out[position] = entry[token] / temperature - np.logaddexp.reduce(scaled)
    return out
