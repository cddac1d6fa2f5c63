"""Errors shared by samplers, environments and the rollout loop."""

from __future__ import annotations


class RetryableError(RuntimeError):
    """A transient failure (sampler timeout, server 5xx, dropped connection): the rollout loop retries
    the whole rollout with exponential backoff up to `inference.max_retries` times. Runtimes and
    environments raise it (or `TimeoutError`) for failures that a second attempt may not hit; any other
    exception marks the trace with `error`."""


class FatalError(RuntimeError):
    """A failure no rollout can recover from (the sampler's engine died): the rollout loop does not turn
    it into an error trace or retry it; it fails the stage, so the step fails and `--resume` redoes it."""


class EngineDeadError(FatalError):
    """An in-process vLLM engine died or stopped answering; the message names the engine and its error."""


class StorageFullError(FatalError):
    """The run's storage has no room (ENOSPC, a quota, a file-size limit): the write failed and was not
    marked complete; the message names what was being written and what to do."""


class RefusedError(ValueError):
    """A command that must not start as asked: what is in the way and the flag or step that resolves it
    (`--resume`, `--overwrite`, another `--out`). The CLI prints the message alone and exits with 2."""
