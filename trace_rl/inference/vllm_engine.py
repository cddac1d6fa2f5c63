"""The `vllm` sampler in this process: one engine per model, started once and reused.

The engine is vLLM's synchronous `LLMEngine`, owned by one worker thread that runs continuous
batching: it adds the queued requests as one group (`EngineWorker._add_requests` says why), steps
the engine, and resolves each request's future when it finishes. Async callers await those futures
from any event loop, so rollouts of many steps (each maybe under its own `asyncio.run`) share one
engine. (vLLM's `AsyncLLM` binds its output handler to the loop it first ran on, which breaks when a
later step runs a new loop.) Weight reloads run on the same thread between engine steps, so no
forward pass sees half-loaded weights; a request still in flight continues on the new weights, so
broadcast between rollout steps.

The engine's processes (EngineCore and its model worker) can die. A monitor thread
checks them twice a second; when one is gone, or an engine step raises, every waiting
caller gets an `EngineDeadError` naming the engine, the process exit code and the last
error the engine logged, and every later request fails at once. Nothing waits forever.
The process that starts an engine starts its reaper first (`trace_rl.machine.reaper`): if that process is killed,
SIGKILL included, the engine's processes die with it, whoever started it (the CLI, a flow run's process, a script);
when it exits without stopping its engines, they stop at its exit (`stop_engines_at_exit`).
The engine's error log and its processes' ZMQ sockets are kept in a temp folder of that process's
(`trace_rl.machine.temp_folders`), removed when the engine stops or the process ends, however it ends.

On CPU, chunked prefill is off: vLLM samples (and discards) a token for a request whose
prompt is only partly scheduled, then rewinds that request's seeded generator with
`Generator.set_offset`, which CPU generators do not have, so seeded requests crashed the
engine as soon as a step's prompts exceeded `max_num_batched_tokens`. Without chunking a
prompt is prefilled in one engine step, so the budget is at least `max_model_len`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import functools
import itertools
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from trace_rl.errors import EngineDeadError
from trace_rl.inference.batcher import running_loop, wait_until_idle
from trace_rl.inference.vllm_logging import configure_this_process, quiet_config, quiet_imports, verbose
from trace_rl.inference.vllm_worker import CPU_SETUP_METHOD, EXTENSION, RELOAD_METHOD
from trace_rl.inference.weights import check_weights, local_tensor_shapes
from trace_rl.machine import reaper, temp_folders
from trace_rl.models.hub import resolve_model_path
from trace_rl.models.lora import check_adapter, is_adapter_dir, vllm_max_lora_rank
from trace_rl.models.runtime import NEUTRAL_SAMPLING, Generation, RuntimeConfig, load_tokenizer, stop_token_ids

LIVENESS_INTERVAL_S = 0.5
EXCEPTION_LINE = re.compile(r"(?:^|\] )((?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b.*)$")


logger = logging.getLogger(__name__)

KV_HEADROOM = 1.25  # over the step's sequences at full length: vLLM's block rounding, a few requests beyond them


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    """Keys and values of one token over all layers: `2 · layers · kv_heads · head_dim · bytes(dtype)`."""
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(model_path)
    text = getattr(model, "text_config", None) or model
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * {"float32": 4}.get(dtype, 2)


def kv_cache_bytes(config: RuntimeConfig) -> int:
    """What a step needs: its sequences in flight, each up to `max_model_len` tokens, with `KV_HEADROOM`."""
    tokens = max(config.step_sequences, 1) * config.max_model_len
    per_token = kv_bytes_per_token(resolve_model_path(config.name, config.revision), config.dtype)
    return int(KV_HEADROOM * tokens * per_token)


def kv_cache_note(config: RuntimeConfig, kv_bytes: int) -> str:
    """What a CPU engine's log says of its KV cache: the size and where it came from."""
    origin = ("set by inference.cpu_kv_cache_gb" if config.cpu_kv_cache_gb is not None else
              f"sized to a step: {config.step_sequences} sequences x {config.max_model_len} tokens")
    return f"KV cache {kv_bytes / 2**20:.0f} MB ({origin})"


def engine_arguments(config: RuntimeConfig, is_cpu: bool) -> dict[str, Any]:
    """The `vllm.LLM` arguments for a runtime config on this platform (see the module docstring for CPU)."""
    arguments: dict[str, Any] = {
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "enforce_eager": config.enforce_eager,
        "seed": config.seed,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": -1,
        "worker_extension_cls": EXTENSION,
        "generation_config": "vllm",  # the model's generation_config.json must not change what is sampled
    }
    if config.dtype != "float32":  # float32 logits from the half-precision hidden states, as the trainer's
        arguments["hf_overrides"] = {"head_dtype": "float32"}
    if config.max_num_batched_tokens is not None:
        arguments["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.lora is not None:
        # one adapter serves at a time: the latest step's (the previous one is removed once it is loaded)
        arguments.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(config.lora.rank), max_loras=1)
    if is_cpu:
        # an explicit KV cache size; `gpu_memory_utilization` would reserve that fraction of all RAM
        arguments["kv_cache_memory_bytes"] = (kv_cache_bytes(config) if config.cpu_kv_cache_gb is None
                                              else int(config.cpu_kv_cache_gb * 2**30))
        arguments["enable_chunked_prefill"] = False
        budget = arguments.setdefault("max_num_batched_tokens", max(config.max_model_len, 4096))
        if budget < config.max_model_len:
            raise ValueError(
                f"inference.max_num_batched_tokens = {budget} is below inference.max_model_len = "
                f"{config.max_model_len}; on CPU chunked prefill is off, so raise it to at least max_model_len"
            )
    else:
        arguments["gpu_memory_utilization"] = config.gpu_memory_utilization
        arguments["enable_sleep_mode"] = config.sleep_mode
    return arguments


class EngineLog:
    """A file that receives vLLM's ERROR records from every process of one engine.

    vLLM's CPU backend spawns its processes, and each configures its own logging from
    `VLLM_LOGGING_CONFIG_PATH`; pointing that, while the engine starts, at vLLM's default
    configuration plus a file handler brings the root cause of a crash in EngineCore or its
    model worker to where this process can read it. A user's own logging set-up
    (`VLLM_LOGGING_CONFIG_PATH` or `VLLM_CONFIGURE_LOGGING=0`) is left alone; errors then
    point to the engine's log.
    """

    def __init__(self, folder: str):
        self.path = os.path.join(folder, "errors.log")
        self.config_path = os.path.join(folder, "logging.json")
        self._handler: logging.Handler | None = None  # this process's records to the file

    @contextlib.contextmanager
    def capturing(self):
        if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
            yield
            return
        from vllm.logger import DEFAULT_LOGGING_CONFIG

        config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
        config["handlers"]["trace_rl_engine_errors"] = {
            "class": "logging.FileHandler", "filename": self.path, "level": "ERROR", "formatter": "vllm",
        }
        config["loggers"]["vllm"]["handlers"].append("trace_rl_engine_errors")
        quiet_config(config)
        with open(self.config_path, "w") as handle:
            json.dump(config, handle)
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = self.config_path
        try:
            self._handler = configure_this_process(self.path)
            yield
        finally:
            del os.environ["VLLM_LOGGING_CONFIG_PATH"]

    def close(self) -> None:
        """Stop this process's records going to the file (the engine's folder, which holds it, goes next)."""
        if self._handler is not None:
            logging.getLogger("vllm").removeHandler(self._handler)
            self._handler.close()

    def last_error(self) -> str | None:
        """The last exception line the engine logged (e.g. `RuntimeError: Worker failed with error ...`)."""
        try:
            with open(self.path) as handle:
                lines = handle.read().splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            match = EXCEPTION_LINE.search(line.strip())
            if match:
                return match.group(1)
        return None


SMALL_CPU_CORES = 2  # on a CPU with at most this many cores, vLLM's model computes on all of them when it can


def computes_on_every_core(config: RuntimeConfig, is_cpu: bool, cores: int) -> bool:
    """Whether the engine's model computes on every core, beside vLLM's scheduler process: on a CPU of at most
    `SMALL_CPU_CORES` cores (`cores`: those this process may run on) where nothing trains while it samples, unless
    the user set `VLLM_CPU_NUM_OF_RESERVED_CPU`.

    vLLM keeps one core for its scheduler, which on 2 cores leaves the model one: on both it samples the demo's step
    1.5x faster and the step after it is no slower. With `[async] max_off_policy_steps` >= 1 the trainer computes on
    those cores while the engine samples, and its steps were a quarter slower with the model on both
    (docs/inference.md)."""
    return (is_cpu and cores <= SMALL_CPU_CORES and not config.samples_beside_training
            and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ)


def engine_environment(folder: str, every_core: bool) -> dict[str, str]:
    """The variables an engine's processes start with, each unless the user set it: `VLLM_RPC_BASE_PATH = folder`
    (vLLM's ZMQ IPC sockets in the engine's folder rather than the temp dir, where vLLM leaves them, 7 an engine at
    every exit), and with `every_core` (`computes_on_every_core`) `VLLM_CPU_NUM_OF_RESERVED_CPU = 0`."""
    values = {"VLLM_RPC_BASE_PATH": folder, **({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"} if every_core else {})}
    return {name: value for name, value in values.items() if name not in os.environ}


@functools.cache
def vllm_on_cpu() -> bool:
    """Whether this process's vLLM computes on the CPU (its platform)."""
    quiet_imports()
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """`values` in this process's environment while an engine starts: the processes it spawns keep them."""
    os.environ.update(values)
    try:
        yield
    finally:
        for name in values:
            os.environ.pop(name, None)


class EngineWorker:
    """A vLLM engine driven by a dedicated thread; submit requests or calls, get futures back."""

    def __init__(self, config: RuntimeConfig, every_core: bool):
        self.model_path = resolve_model_path(config.name, config.revision)
        self.name = f"vLLM engine for {config.key!r} ({self.model_path})"
        self._config = config
        self._every_core = every_core  # its model computes on every core (`computes_on_every_core`)
        self._inbox: queue.Queue = queue.Queue()
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._error: EngineDeadError | None = None
        self.asleep = False  # slept at level 1 for a colocated trainer (VLLMEngineRuntime.sleep)
        self.weights_owner = None  # the runtime whose load_weights last replaced the full weights (None: none yet)
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._lora_ids = itertools.count(1)
        self.folder = temp_folders.make("vllm")  # its error log and its processes' ZMQ sockets
        self._log = EngineLog(self.folder)
        self._started: Future = Future()
        reaper.start()
        self._thread = threading.Thread(target=self._run, name=f"vllm-engine-{config.key}", daemon=True)
        self._thread.start()
        self.llm = self._started.result()
        threading.Thread(target=self._monitor, name=f"vllm-monitor-{config.key}", daemon=True).start()

    def _start_engine(self):
        quiet_imports()
        from vllm import LLM

        arguments = engine_arguments(self._config, vllm_on_cpu())
        if "kv_cache_memory_bytes" in arguments:
            logger.info("%s: %s", self.name, kv_cache_note(self._config, arguments["kv_cache_memory_bytes"]))
        try:
            with self._log.capturing(), environment(engine_environment(self.folder, self._every_core)):
                llm = LLM(model=self.model_path, use_tqdm_on_load=verbose(), **arguments)
                llm.collective_rpc(CPU_SETUP_METHOD)
                return llm
        except Exception as exc:
            raise EngineDeadError(f"{self.name} failed to start: {self._describe(exc)}") from exc

    # -- liveness -----------------------------------------------------------------------
    def _processes(self) -> list:
        manager = getattr(self.llm.llm_engine.engine_core.resources, "engine_manager", None)
        return list(getattr(manager, "processes", []))

    def _dead_reason(self) -> str | None:
        """Why the engine is dead, or None while its processes run."""
        exited = [p for p in self._processes() if not p.is_alive()]
        if exited:
            codes = ", ".join(f"{p.name} pid {p.pid} exit code {p.exitcode}" for p in exited)
            return f"its process exited ({codes})"
        if getattr(self.llm.llm_engine.engine_core.resources, "engine_dead", False):
            return "vLLM marked it dead"
        return None

    def _describe(self, exc: BaseException | None = None, reason: str | None = None) -> str:
        """The reason, the exception and the last error the engine logged (vLLM's own EngineDeadError
        only says to look at the log, so it gives way to what the log says)."""
        logged = self._log.last_error()
        parts = [reason] if reason else []
        if exc is not None and not (logged and type(exc).__name__ == "EngineDeadError"):
            parts.append(f"{type(exc).__name__}: {exc}")
        if logged:
            parts.append(f"engine error: {logged}")
        return "; ".join(parts) or "no error was logged; see the engine's log above"

    def _monitor(self) -> None:
        while not self._stopping.wait(LIVENESS_INTERVAL_S) and self._error is None:
            reason = self._dead_reason()
            if reason is not None:
                time.sleep(LIVENESS_INTERVAL_S)  # let the dying process finish logging its error
                self._fail(EngineDeadError(f"{self.name} died: {self._describe(reason=reason)}"))

    def _fail(self, error: EngineDeadError) -> None:
        """Mark the engine dead and hand `error` to every caller waiting on it, now or later."""
        with self._lock:
            if self._error is None:
                self._error = error
            waiting = list(self._pending.values())
            self._pending.clear()
            while not self._inbox.empty():
                waiting.append(self._inbox.get_nowait()[2])
        for future in waiting:
            if not future.done():
                future.set_exception(self._error)

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            llm = self._start_engine()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for the engine
            self._started.set_exception(exc)
            return
        self._started.set_result(llm)
        engine = llm.llm_engine
        while self._error is None:
            busy = engine.has_unfinished_requests()
            try:
                commands = [self._inbox.get(block=not busy)]
            except queue.Empty:
                commands = []
            if commands and not busy:  # a step's first requests: take all the loops that sent them can send
                for loop in {command[3] for command in commands if command[3] is not None}:
                    wait_until_idle(loop)
            while not self._inbox.empty():
                commands.append(self._inbox.get_nowait())
            for are_requests, group in itertools.groupby(commands, key=lambda command: command[0] == "request"):
                if are_requests:
                    self._add_requests(engine, list(group))
                    continue
                for kind, (command_id, payload), future, _ in group:
                    if kind == "stop":
                        engine.engine_core.shutdown()
                        future.set_result(None)
                        return
                    if not future.set_running_or_notify_cancel():
                        continue
                    with self._lock:  # whoever pops a pending future resolves it: this thread or `_fail`
                        self._pending[command_id] = future
                    try:
                        self._resolve(command_id, result=payload(llm))
                    except Exception as exc:  # noqa: BLE001 - reported to the caller through its future
                        self._failed(command_id, exc)
            if self._error is None and engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001 - every waiting caller gets the engine's error
                    self._fail(EngineDeadError(f"{self.name} failed in an engine step: {self._describe(exc)}"))
                    return
                for output in outputs:
                    if output.finished:
                        self._resolve(output.request_id, result=output)

    def _add_requests(self, engine, commands: list) -> None:
        """Add requests that arrived together as one group, in the order of what they ask (seed, then prompt).

        vLLM's engine core runs in its own process and schedules as soon as it holds a request, and each request
        reaches it as a message of its own, so without the hold its first engine step would batch whichever of
        them had arrived: a different batch on each run, and on CPU a batch's rows round differently with its
        size and order (bfloat16 on an AMX Xeon sampled other tokens). Its scheduler is paused ("keep": running
        requests keep their place) while the group is added."""
        commands = sorted((c for c in commands if c[2].set_running_or_notify_cancel()), key=request_order)
        with self._lock:
            self._pending.update((command_id, future) for _, (command_id, _), future, _ in commands)
        held = len(commands) > 1 and hasattr(engine.engine_core, "call_utility")  # in-process cores step on call
        try:
            if held:
                engine.engine_core.call_utility("pause_scheduler", "keep", False)
            for _, (command_id, (prompt_ids, params, lora_request)), _, _ in commands:
                try:
                    engine.add_request(command_id, {"type": "token", "prompt_token_ids": prompt_ids}, params,
                                       lora_request=lora_request)
                except Exception as exc:  # noqa: BLE001 - reported to the caller through its future
                    self._failed(command_id, exc)
            if held and self._error is None:
                engine.engine_core.call_utility("resume_scheduler")
        except Exception as exc:  # noqa: BLE001 - an engine whose scheduler may stay paused is of no more use
            self._fail(EngineDeadError(f"{self.name}: its scheduler did not pause or resume: {self._describe(exc)}"))

    def _failed(self, command_id: str, exc: Exception) -> None:
        """A command raised: the engine died (every caller hears of it), or only this command failed."""
        reason = self._dead_reason()
        if reason is not None:
            self._fail(EngineDeadError(f"{self.name} died: {self._describe(exc, reason)}"))
        else:
            self._resolve(command_id, error=exc)

    def _resolve(self, command_id: str, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            future = self._pending.pop(command_id, None)
        if future is None:  # already failed by `_fail`
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # -- callers ---------------------------------------------------------------------------
    def _enqueue(self, kind: str, payload) -> Future:
        future: Future = Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(self._error)
                return future
            # a request's loop, to wait for its other requests; a call's caller may block its loop on the call
            loop = running_loop() if kind == "request" else None
            self._inbox.put((kind, (f"{kind}-{next(self._ids)}", payload), future, loop))
        return future

    def submit(self, prompt_ids: list[int], params, lora_request=None) -> Future:
        return self._enqueue("request", (prompt_ids, params, lora_request))

    def next_lora_id(self) -> int:
        """A LoRA id this engine has not used (vLLM caches adapters by id, so a new adapter needs a new one)."""
        return next(self._lora_ids)

    def call(self, function: Callable[[Any], Any]) -> Future:
        """Run `function(llm)` on the engine thread between two engine steps."""
        return self._enqueue("call", function)

    async def wait(self, future: Future, timeout_s: float, what: str):
        """Await a call that holds the engine thread; past `timeout_s` the engine counts as hung (dead) and is
        not used again. (Requests need no timeout here: the monitor fails them when the engine dies, and
        the sampler times out slow ones itself.)"""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            error = EngineDeadError(f"{self.name}: {what} got no answer in {timeout_s:g}s; the engine is not used "
                                    "again in this process (resume the run to start a new one)")
            self._fail(error)
            raise error from None

    def stop(self) -> None:
        """Shut the engine down (its processes exit) and end the thread."""
        self._stopping.set()
        future = self._enqueue("stop", None)
        if self._error is not None or not self._thread.is_alive():
            self.llm.llm_engine.engine_core.shutdown()
        else:
            future.result()
            self._thread.join()
        self._log.close()
        temp_folders.remove(self.folder)
        with self._lock:  # a runtime still holding this engine fails at once instead of waiting forever
            self._error = self._error or EngineDeadError(f"{self.name} was shut down in this process; build a new "
                                                         "runtime to start a new engine")


ENGINES: dict[tuple, EngineWorker] = {}
ENGINES_LOCK = threading.Lock()


def engine_for(config: RuntimeConfig) -> EngineWorker:
    """The process's engine for this runtime key and model (started on first use).

    Keyed by the runtime key too: a `reference` must keep its weights when `policy`,
    though the same model, receives a broadcast; and by the LoRA rank it serves (an engine
    with LoRA enabled is started for LoRA runs only), and by whether its model computes on every core
    (`computes_on_every_core`: a synchronous and an asynchronous run on 2 cores get one engine each). Not keyed by
    the run seed: every request carries its own seed, so runs of different seeds share an engine. A dead engine is
    replaced by a new one.
    """
    every_core = computes_on_every_core(config, vllm_on_cpu(), len(os.sched_getaffinity(0)))
    key = (config.key, resolve_model_path(config.name, config.revision), config.dtype, config.max_model_len,
           config.max_num_batched_tokens, config.enforce_eager, config.sleep_mode,
           config.lora and vllm_max_lora_rank(config.lora.rank), every_core)
    stop_engines_at_exit()
    with ENGINES_LOCK:
        if key in ENGINES and ENGINES[key]._error is not None:
            del ENGINES[key]
        if key not in ENGINES:
            ENGINES[key] = EngineWorker(config, every_core)
        return ENGINES[key]


def shutdown_engines(at_once: bool = True) -> None:
    """Stop every engine of this process, all at once (each waits seconds for its processes to exit), or one
    after another (at exit, where no new thread may start)."""
    with ENGINES_LOCK:
        engines = list(ENGINES.values())
        ENGINES.clear()
        if at_once and len(engines) > 1:
            with ThreadPoolExecutor(max_workers=len(engines)) as pool:
                list(pool.map(EngineWorker.stop, engines))
        else:
            for engine in engines:
                engine.stop()


@functools.cache
def stop_engines_at_exit() -> None:
    """Have this process stop its engines when it exits, before multiprocessing joins its child processes.

    vLLM's engine-core process is not a daemon, and it exits when its engine shuts down, which vLLM leaves to
    weakref finalizers. A process that made any weakref finalizer before it imported multiprocessing runs
    those finalizers after multiprocessing's join at exit, which then waits on the engine core for good: a
    script that never called `shutdown_engines` did not exit. atexit runs the handler registered last first,
    and this one is registered after multiprocessing's."""
    import multiprocessing.util  # noqa: F401 - registers its exit handler when first imported

    atexit.register(shutdown_engines, at_once=False)


class VLLMEngineRuntime:
    """A `ModelRuntime` over the process's in-process vLLM engine for a model."""

    num_endpoints = 1

    def __init__(self, config: RuntimeConfig):
        self.key = config.key
        self.config = config
        self.policy_step = 0
        self.worker = engine_for(config)
        self.tokenizer = load_tokenizer(self.worker.model_path)
        self.stop_token_ids = stop_token_ids(self.tokenizer, config.stop_tokens, config.key)
        self.vocab_size = self.worker.llm.llm_engine.model_config.get_vocab_size()
        self._expected = local_tensor_shapes(self.worker.model_path)
        # a tied output layer is the embedding: its checkpoints leave `lm_head.weight` out (any other must have it)
        hf_config = self.worker.llm.llm_engine.model_config.hf_text_config
        self._tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
        self.adapter = None  # with [model.lora]: the LoRARequest of the adapter every request carries

    def _lora(self, adapter: bool):
        return self.adapter if adapter else None

    async def generate(
        self, prompt_ids: list[int], *, temperature: float, max_tokens: int, top_p: float = 1.0, seed: int = 0,
        stop: Sequence[str] = (), adapter: bool = True,
    ) -> Generation:
        """Sample a completion; `adapter=False` samples the base model under a loaded LoRA adapter."""
        output = await asyncio.wrap_future(self.worker.submit(list(prompt_ids), sampling_params(
            self.stop_token_ids, stop, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
            logprobs=0), self._lora(adapter)))
        output = output.outputs[0]
        token_ids = list(output.token_ids)
        logprobs = [entry[token].logprob for token, entry in zip(token_ids, output.logprobs)]
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=output.finish_reason or "length")

    async def score(
        self, token_ids: list[int], *, temperature: float = 1.0, endpoint: int = 0, adapter: bool = True
    ) -> np.ndarray:
        """Per-token logprobs from vLLM's prompt logprobs (raw, i.e. at temperature 1).

        At another temperature it asks for the full distribution at each position and
        rescales it: log_softmax(raw_logprobs / T) = log_softmax(logits / T). That costs
        vocabulary-size work per token, so it is refused for large vocabularies.
        `adapter=False` scores with the base model under a loaded LoRA adapter.
        """
        from vllm import SamplingParams

        full = temperature != 1.0
        if full:
            check_full_distribution_scoring(self.key, self.vocab_size, temperature)
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1 if full else 0, detokenize=False)
        output = await asyncio.wrap_future(self.worker.submit(list(token_ids), params, self._lora(adapter)))
        positions = [{t: lp.logprob for t, lp in entry.items()} for entry in output.prompt_logprobs[1:]]
        return prompt_logprobs_at(token_ids, positions, temperature)

    async def load_weights(self, local_dir: str, version: int) -> None:
        """Check the new weights, then reload them in place between two engine steps and drop the
        prefix cache (its KV entries were computed with the old weights).

        A peft adapter directory (a LoRA run's `weights/<step>/`) is loaded as a new adapter
        under a new name and id instead, which every later request carries; the previous one is
        removed. Full weights (the base model at step 0) drop the adapter."""
        if is_adapter_dir(local_dir):
            await self._load_adapter(local_dir, version)
        else:
            check_weights(local_dir, self._expected, optional=self._tied)

            def reload(llm) -> None:
                llm.collective_rpc(RELOAD_METHOD, kwargs={"weights_path": local_dir})
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache after the weight reload")

            await self.worker.wait(self.worker.call(reload), self.config.reload_timeout_s, "a weight reload")
            self.worker.weights_owner = self
            await self._swap_adapter(None)
        self.policy_step = version

    @property
    def holds_its_weights(self) -> bool:
        """Whether the engine still runs what this runtime loaded last. The engine is the process's, shared by
        every session of the same model: another run's session may have loaded its own weights since. A LoRA
        adapter is this runtime's alone (every request carries it)."""
        return self.adapter is not None or self.worker.weights_owner is self

    async def sleep(self) -> None:
        """Free the GPU for a colocated trainer: level 1 moves the weights to CPU memory and drops the KV cache.
        Nothing to do without sleep mode (on CPU, or not colocated)."""
        if self.config.sleep_mode and not self.worker.asleep:
            await self.worker.wait(self.worker.call(lambda llm: llm.sleep(level=1)), self.config.reload_timeout_s,
                                   "sleep")
            self.worker.asleep = True

    async def wake_up(self) -> None:
        """Take the GPU back after the trainer: weights back from CPU memory, a fresh KV cache."""
        if self.worker.asleep:
            import torch

            torch.cuda.empty_cache()  # an in-process trainer's allocator keeps the step's freed activations cached
            await self.worker.wait(self.worker.call(lambda llm: llm.wake_up()), self.config.reload_timeout_s,
                                   "wake up")
            self.worker.asleep = False

    async def _load_adapter(self, local_dir: str, version: int) -> None:
        from vllm.lora.request import LoRARequest

        if self.config.lora is None:
            raise ValueError(f"{local_dir} holds a LoRA adapter, but model {self.key!r} has no [model.lora]")
        check_adapter(local_dir, vllm_max_lora_rank(self.config.lora.rank))
        lora_id = self.worker.next_lora_id()
        await self._swap_adapter(LoRARequest(f"{self.key}-step-{version}-{lora_id}", lora_id, local_dir))

    async def _swap_adapter(self, new) -> None:
        """Load `new` (a LoRARequest, or None for none) into the engine, then remove the current adapter."""
        old = self.adapter
        if new is None and old is None:
            return

        def swap(llm) -> None:
            if new is not None and not llm.llm_engine.add_lora(new):
                raise RuntimeError(f"vLLM did not load the LoRA adapter {new.lora_path}")
            if old is not None:
                llm.llm_engine.remove_lora(old.lora_int_id)

        await self.worker.wait(self.worker.call(swap), self.config.reload_timeout_s, "a LoRA adapter load")
        self.adapter = new


FULL_DISTRIBUTION_MAX_VOCAB = 32768


def check_full_distribution_scoring(key: str, vocab_size: int, temperature: float) -> None:
    """Scoring at T != 1 through vLLM needs every token's prompt logprob at every position; past
    FULL_DISTRIBUTION_MAX_VOCAB that is gigabytes of Python objects per sequence, so say what to do instead."""
    if vocab_size > FULL_DISTRIBUTION_MAX_VOCAB:
        raise ValueError(
            f"model {key!r}: scoring at temperature {temperature:g} on vLLM needs the full distribution of its "
            f"{vocab_size}-token vocabulary at every position (vLLM's prompt logprobs are at temperature 1); "
            "score at temperature 1.0 (e.g. the opd/opsd option temperature = 1.0) or use backend = 'hf'"
        )


def request_order(command) -> tuple:
    """The order of a group of requests in an engine's batch: by what each asks, not by when it arrived (rollouts
    that wait on a tool or a sandbox arrive in another order on each run)."""
    prompt_ids, params, lora_request = command[1][1]
    return params.seed is None, params.seed or 0, prompt_ids, lora_request.lora_int_id if lora_request else 0


def sampling_params(stop_token_ids: list[int], stop: Sequence[str], **fields):
    """vLLM SamplingParams of one request: its own fields, the stop tokens and strings, and every other knob
    neutral. Only a request with stop strings is detokenized (vLLM matches them on the text)."""
    from vllm import SamplingParams

    return SamplingParams(detokenize=bool(stop), stop=list(stop), stop_token_ids=stop_token_ids, ignore_eos=True,
                          **NEUTRAL_SAMPLING, **fields)


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
