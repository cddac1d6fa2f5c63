"""Starting, resuming and overwriting a run directory: data is never silently replaced."""

from __future__ import annotations

import logging
from typing import Literal

from trace_rl.config import Config, config_hash, config_to_toml
from trace_rl.errors import RefusedError
from trace_rl.losses import loss_notes
from trace_rl.runs.loading import check_config
from trace_rl.runs.preflight import check_reachable
from trace_rl.storage import RunStorage, check_run_version, check_wipe, eval_dir, first_unfinished_step, record_run_version

logger = logging.getLogger(__name__)
Mode = Literal["new", "resume", "overwrite"]


class RunExistsError(RefusedError):
    pass


def run_exists(storage: RunStorage) -> bool:
    return storage.exists(storage.root) and bool(storage.fs.ls(storage.root, detail=False))


def check_run(config: Config, mode: Mode) -> RunStorage:
    """The run's storage, or RunExistsError when a new run would land in an existing run directory. The CLI
    calls this before any flow run starts; `prepare_run` again (runs started from the Prefect UI)."""
    storage = RunStorage.of(config)
    check_writable(config, storage)
    if mode == "new" and run_exists(storage):
        raise RunExistsError(
            f"run directory {storage.url} already exists; pass --resume to continue it or --overwrite to wipe it "
            "first (or choose another name)"
        )
    if mode == "overwrite":
        check_wipe(storage, "--overwrite")
    if mode == "resume" and storage.exists(storage.path("config.toml")):  # a run started by some trace-rl
        check_run_version(storage, "--resume")
    return storage


def check_writable(config: Config, storage: RunStorage) -> None:
    """A small file written and removed in the run directory (which is left, empty, for a new run), or a
    RefusedError naming `storage` and the fix: a path through a file, no permission, S3 without credentials."""
    probe = storage.path(".write-check")
    try:
        storage.write_atomic(probe, b"")
        storage.remove(probe)
    except Exception as exc:  # OSError locally; botocore's NoCredentialsError, ClientError, ... remotely
        local = storage.protocol in ("file", "local")
        fix = ("set storage to a directory you can write to, e.g. --set storage=runs" if local else
               "fix storage, or storage_options (credentials, endpoint_url)")
        raise RefusedError(f"storage = {config.storage!r}: cannot write to the run directory {storage.url} "
                           f"({type(exc).__name__}: {exc}); {fix}") from None


def finished_message(config: Config, storage: RunStorage) -> str | None:
    """What to say when resuming the run has nothing left to do (every step trained and every eval done);
    None otherwise."""
    first = first_unfinished_step(storage)
    if first <= config.steps:
        return None
    from trace_rl.eval.evaluation import evaluates_at

    if any(evaluates_at(config, step) and not storage.is_stable(eval_dir(storage, step)) for step in range(1, first)):
        return None  # the resume runs the evals the last process did not finish
    last = first - 1
    done = (f"all {config.steps} steps are trained" if last == config.steps
            else f"it is trained to step {last}, past steps = {config.steps}")
    return (f"{config.name} is already finished: {done} ({storage.url}); nothing to do. To train on, raise steps: "
            f"--resume --set steps=N with N > {last}")


def prepare_run(config: Config, mode: Mode) -> tuple[RunStorage, int]:
    """Check the config and set up the run directory; return its storage and the first step to run (1-based).

    The config is checked here too (not only by the CLI): a run started from the Prefect UI gets
    its config as a flow parameter, validated by the schema alone."""
    check_config(config, on_this_machine=True)
    storage = check_run(config, mode)
    check_reachable(config)
    config_path = storage.path("config.toml")
    if mode == "overwrite" and run_exists(storage):
        logger.warning("--overwrite: deleting the existing run directory %s", storage.url)
        storage.remove(storage.root)
    if mode == "resume" and storage.exists(config_path):
        previous = storage.read_bytes(config_path).decode()
        if previous != config_to_toml(config):
            logger.warning("resuming %s with a changed config (config hash now %s); finished stages made from the "
                           "old config are not reused", storage.url, config_hash(config))
    storage.write_atomic(config_path, config_to_toml(config).encode())
    record_run_version(storage)
    for note in loss_notes(config.trainer.loss):
        logger.warning(note)
    first = first_unfinished_step(storage)
    if mode == "resume":
        logger.info("resuming %s at step %d", storage.url, first)
    return storage, first
