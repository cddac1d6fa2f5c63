"""The process's sessions: one per run and config, the most recently used kept warm."""

from __future__ import annotations

import asyncio
import tempfile
import time

import numpy as np

from tests.conftest import VLLM_ENGINE
from tests.inference.conftest import save_updated_model, trainer_logprobs
from trace_rl.machine import processes
from trace_rl.names import POLICY
from trace_rl.pipeline import session
from trace_rl.runs.loading import validate_config


def test_a_serving_process_keeps_only_the_most_recently_used_sessions(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_SESSIONS", type(session._SESSIONS)())
    configs = [validate_config({"name": name, "storage": str(tmp_path), "env": [{"id": "reverse-text"}]})
               for name in ("a", "b", "c")]
    a, b = session.session_for(configs[0]), session.session_for(configs[1])
    assert session.session_for(configs[0]) is a  # used again: the most recent now
    session.session_for(configs[2])  # evicts b, the least recently used
    assert session.MAX_SESSIONS == 2 and [s.config.name for s in session._SESSIONS.values()] == ["a", "c"]
    assert session.session_for(configs[0]) is a and session.session_for(configs[1]) is not b


def test_an_evicted_session_stops_its_trainer_workers(tmp_path, monkeypatch, tiny_model_path):
    """`trace-rl serve` with more runs than MAX_SESSIONS: the evicted run's torchrun workers do not outlive it."""
    monkeypatch.setattr(session, "_SESSIONS", type(session._SESSIONS)())
    configs = [validate_config({"name": name, "storage": str(tmp_path), "env": [{"id": "reverse-text"}],
                                "model": {"name": tiny_model_path},
                                "trainer": {"num_processes": 2, "device": "cpu"}}) for name in ("a", "b", "c")]
    workers = session.session_for(configs[0]).trainer.at(1)
    workers.start()
    ranks = {pid: processes.stat(pid).start for pid in workers.pids}
    assert len(ranks) == 2 and all(processes.is_alive(pid, start) for pid, start in ranks.items())
    session.session_for(configs[1])
    session.session_for(configs[2])  # evicts a
    deadline = time.monotonic() + 60
    while workers.process is not None and time.monotonic() < deadline:  # stopped: its launcher has exited
        time.sleep(0.1)
    assert workers.process is None and not workers.alive
    assert not any(processes.is_alive(pid, start) for pid, start in ranks.items())


def test_runs_sharing_the_process_engine_each_sample_their_own_weights(tmp_path, shared_vllm, tiny_model_path):
    """Two runs in one process (`trace-rl serve`, a bench) share its vLLM engine: when their steps interleave, a
    step loads its run's weights again after the other run's step replaced them, even at the same policy step."""
    a, b = (session.Session(validate_config({
        "name": name, "storage": str(tmp_path), "env": [{"id": "reverse-text"}], "model": {"name": "tiny"},
        "inference": {"backend": "vllm", **VLLM_ENGINE}})) for name in ("a", "b"))
    with tempfile.TemporaryDirectory() as staging:
        save_updated_model(tiny_model_path, staging)
        a.storage.upload_dir(staging, a.storage.path("weights", "000001"))
    tokens = [1, 17, 29, 42, 56, 70, 71, 72, 73]
    updated = trainer_logprobs(a.storage.path("weights", "000001"), tokens, 1.0)
    base = trainer_logprobs(tiny_model_path, tokens, 1.0)

    async def interleaved() -> list[np.ndarray]:
        scored = []
        for run, wanted in ((a, 1), (b, 0), (a, 1)):
            await run.load_policy(wanted)
            scored.append(await run.runtimes[POLICY].score(tokens))
        return scored

    first, other, again = asyncio.run(interleaved())
    assert a.runtimes[POLICY].worker is b.runtimes[POLICY].worker is shared_vllm.worker
    assert np.abs(updated - base).max() > 1e-2
    np.testing.assert_allclose(first, updated, atol=2e-4)
    np.testing.assert_allclose(other, base, atol=2e-4)
    np.testing.assert_allclose(again, updated, atol=2e-4)
    assert a.runtimes[POLICY].holds_its_weights and not b.runtimes[POLICY].holds_its_weights
