"""The process's sessions: one per run and config, the most recently used kept warm."""

from __future__ import annotations

import time

from trace_rl.machine import processes
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
