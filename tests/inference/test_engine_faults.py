"""The in-process vLLM engine under load and when it dies (issue 20).

Seeded requests whose prompts together exceed one engine step's token budget used to crash
vLLM's CPU worker (`CPU Generator does not use offset`, from rewinding the generator of a
partly prefilled prompt). Chunked prefill is off on CPU now; these tests run the multi-turn
envs past the budget, and kill a real engine to check that nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from tests.conftest import VLLM_ENGINE, VLLM_OVERRIDES
from trace_rl.errors import EngineDeadError
from trace_rl.inference.build import build_runtime
from trace_rl.inference.vllm_engine import (computes_on_every_core, engine_arguments, engine_environment,
                                            kv_cache_note)
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.runs.loading import load_config

pytestmark = pytest.mark.vllm
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def test_cpu_engine_prefills_whole_prompts_within_a_budget_of_at_least_max_model_len():
    config = RuntimeConfig(key="policy", name="m", backend="vllm", max_model_len=2048, cpu_kv_cache_gb=0.25)
    cpu = engine_arguments(config, is_cpu=True)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 4096
    assert "enable_chunked_prefill" not in engine_arguments(config, is_cpu=False)  # GPUs rewind seeds fine
    with pytest.raises(ValueError, match=r"max_num_batched_tokens = 1024 is below inference.max_model_len = 2048"):
        engine_arguments(config.model_copy(update={"max_num_batched_tokens": 1024}), is_cpu=True)


def test_the_cpu_kv_cache_is_sized_to_the_steps_sequences_unless_set():
    """demo.toml: 8 examples x 8 rollouts in flight, 1,024 tokens each, 1 KB of keys and values per token of the
    tiny model (2 layers x 2 KV heads x 32 dims x float32, keys and values), +25%: 80 MB instead of a fixed 1 GB."""
    from trace_rl.pipeline.colocation import runtime_configs

    policy = runtime_configs(load_config(os.path.join(CONFIGS, "demo.toml")), cuda_available=False)["policy"]
    assert policy.step_sequences == 64 and policy.cpu_kv_cache_gb is None
    assert engine_arguments(policy, is_cpu=True)["kv_cache_memory_bytes"] == int(1.25 * 64 * 1024 * 1024)
    fewer = policy.model_copy(update={"step_sequences": 8, "max_model_len": 256})
    assert engine_arguments(fewer, is_cpu=True)["kv_cache_memory_bytes"] == int(1.25 * 8 * 256 * 1024)
    fixed = policy.model_copy(update={"cpu_kv_cache_gb": 0.5})
    assert engine_arguments(fixed, is_cpu=True)["kv_cache_memory_bytes"] == 2**29
    # what the engine's log says when it starts (shown with --verbose)
    assert kv_cache_note(policy, int(1.25 * 64 * 1024 * 1024)) == (
        "KV cache 80 MB (sized to a step: 64 sequences x 1024 tokens)")
    assert kv_cache_note(fixed, 2**29) == "KV cache 512 MB (set by inference.cpu_kv_cache_gb)"


def test_on_a_cpu_of_two_cores_the_model_computes_on_both_unless_the_trainer_computes_beside_it(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    from trace_rl.pipeline.colocation import runtime_configs

    configs = {k: runtime_configs(load_config(os.path.join(CONFIGS, "math.toml"), [f"async.max_off_policy_steps={k}"]),
                                  cuda_available=False)["policy"] for k in (0, 1)}
    assert computes_on_every_core(configs[0], is_cpu=True, cores=2)
    assert computes_on_every_core(configs[0], is_cpu=True, cores=1)
    assert not computes_on_every_core(configs[1], is_cpu=True, cores=2)  # the trainer needs a core meanwhile
    assert not computes_on_every_core(configs[0], is_cpu=True, cores=4)  # vLLM keeps one of 4
    assert not computes_on_every_core(configs[0], is_cpu=False, cores=2)
    assert engine_environment("/f", every_core=True) == {"VLLM_RPC_BASE_PATH": "/f",
                                                         "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert engine_environment("/f", every_core=False) == {"VLLM_RPC_BASE_PATH": "/f"}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/mine")
    assert not computes_on_every_core(configs[0], is_cpu=True, cores=2)
    assert engine_environment("/f", every_core=True) == {}


def worker_cores(engine_pid: int) -> set[int]:
    """The cores the threads of an engine's model worker (EngineCore's child) may run on."""
    with open(f"/proc/{engine_pid}/task/{engine_pid}/children") as handle:
        (worker,) = handle.read().split()
    return set().union(*(os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{worker}/task")))


def test_seeded_requests_past_the_step_budget_sample_the_same_tokens_as_alone(vllm_runtime):
    prompts = [[(7 * i + j) % 250 + 5 for j in range(300)] for i in range(8)]  # 2400 tokens > 1024 per step

    async def sample(batch):
        return await asyncio.gather(*(vllm_runtime.generate(p, temperature=1.0, max_tokens=6, seed=i)
                                      for i, p in batch))

    together = asyncio.run(sample(list(enumerate(prompts))))
    alone = asyncio.run(sample([(3, prompts[3])]))
    assert sum(map(len, prompts)) > VLLM_ENGINE["max_num_batched_tokens"]
    assert alone[0].token_ids == together[3].token_ids
    assert len({tuple(g.token_ids) for g in together}) > 1


@pytest.mark.parametrize("name", ["alphabet-sort", "link-nav"])
def test_multi_turn_envs_train_two_steps_past_the_step_budget(name, tmp_path, shared_vllm):
    """The configs that crashed, two steps each, with more prompt tokens in flight than one engine step takes."""
    from trace_rl.pipeline.session import Session
    from trace_rl.pipeline.step import run_step
    from trace_rl.tables import read_traces

    config = load_config(os.path.join(CONFIGS, f"{name}.toml"),
                         [*VLLM_OVERRIDES, f"storage={tmp_path}", "steps=2", "env.0.batch_size=4",
                          "env.0.group_size=4"])
    session = Session(config)
    for step in (1, 2):
        run_step(session, step)
        traces = read_traces(session.storage, step)
        assert all(t.error is None for t in traces), [t.error for t in traces if t.error][:3]
        first_prompts = sum(int((~t.branches[0].sampled).argmin()) for t in traces)
        assert first_prompts > VLLM_ENGINE["max_num_batched_tokens"]
        assert max(t.metrics["turns"] for t in traces) >= 2
    assert session.storage.stable_steps("weights") == [1, 2]


def engine_pid(runtime) -> int:
    (process,) = runtime.worker._processes()
    return process.pid


class Watched(logging.Handler):
    """A handler that remembers being closed."""

    closed = False

    def emit(self, record: logging.LogRecord) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        super().close()


def test_an_engine_killed_while_sampling_fails_every_wait_within_seconds(tiny_model_path):
    """A second engine (key `victim`), SIGKILLed under load: sampling, scoring and reloads all fail fast. Building it
    leaves this process's logging alone: vLLM's `dictConfig` would close every handler here (Prefect's API log
    handler among them, whose flush once deadlocked an engine's start inside a flow run)."""
    watched = Watched()
    logging.getLogger().addHandler(watched)
    try:
        runtime = build_runtime(RuntimeConfig(key="victim", name=tiny_model_path, backend="vllm", **VLLM_ENGINE))
    finally:
        logging.getLogger().removeHandler(watched)
    assert not watched.closed
    # its error log and its processes' ZMQ sockets in a temp folder of this process's, not loose in the temp dir
    folder = Path(runtime.worker.folder)
    assert folder.name.startswith(f"trace-rl-{os.getpid()}-vllm-")
    assert {"errors.log", "logging.json"} <= {p.name for p in folder.iterdir()}
    assert sum(stat.S_ISSOCK(p.stat().st_mode) for p in folder.iterdir()) >= 2
    consoles = [h for h in logging.getLogger("vllm").handlers if h.get_name() == "trace_rl_vllm_console"]
    assert len(consoles) == 1 and consoles[0].level == logging.WARNING
    cores = os.sched_getaffinity(0)
    if computes_on_every_core(runtime.config, is_cpu=True, cores=len(cores)):
        assert worker_cores(engine_pid(runtime)) == cores  # none kept for the scheduler (vllm_engine.py says why)
    elif "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        assert worker_cores(engine_pid(runtime)) < cores  # vLLM's default: one kept for the scheduler

    async def sample_then_kill():
        prompt = list(range(5, 205))
        requests = [asyncio.ensure_future(runtime.generate(prompt, temperature=1.0, max_tokens=512, seed=i))
                    for i in range(8)]
        await asyncio.sleep(0.5)
        os.kill(engine_pid(runtime), signal.SIGKILL)
        return await asyncio.gather(*requests, return_exceptions=True)

    started = time.monotonic()
    results = asyncio.run(sample_then_kill())
    assert time.monotonic() - started < 30
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "vLLM engine for 'victim'" in str(results[0]) and "exit code -9" in str(results[0])
    for later in (runtime.score([5, 6, 7]), runtime.load_weights(tiny_model_path, 1),
                  runtime.generate([5, 6], temperature=1.0, max_tokens=2, seed=0)):
        with pytest.raises(EngineDeadError, match="victim"):
            asyncio.run(asyncio.wait_for(later, 10))
    assert runtime.policy_step == 0
    runtime.worker.stop()
    assert not folder.exists()
