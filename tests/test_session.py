"""The process's sessions: one per run and config, the most recently used kept warm."""

from __future__ import annotations

from trace_rl import session
from trace_rl.loading import validate_config


def test_a_serving_process_keeps_only_the_most_recently_used_sessions(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_SESSIONS", type(session._SESSIONS)())
    configs = [validate_config({"name": name, "storage": str(tmp_path), "env": [{"id": "reverse-text"}]})
               for name in ("a", "b", "c")]
    a, b = session.session_for(configs[0]), session.session_for(configs[1])
    assert session.session_for(configs[0]) is a  # used again: the most recent now
    session.session_for(configs[2])  # evicts b, the least recently used
    assert session.MAX_SESSIONS == 2 and [s.config.name for s in session._SESSIONS.values()] == ["a", "c"]
    assert session.session_for(configs[0]) is a and session.session_for(configs[1]) is not b
