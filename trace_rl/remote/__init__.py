"""Env-owned algorithms across a process boundary: the env server and its client (see docs/remote.md)."""

from trace_rl.remote.client import RemoteAlgorithmError, remote_server_for, run_remote_algorithm

__all__ = ["RemoteAlgorithmError", "remote_server_for", "run_remote_algorithm"]
