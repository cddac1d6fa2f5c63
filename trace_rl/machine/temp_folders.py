"""A process's temp folders, which go with it however it ends.

`make(kind)` creates `<tempdir>/trace-rl-<pid>-<kind>-<random>/`, readable by its user only, for the files a
process and the programs it starts would otherwise leave in the temp dir: a vLLM engine's error log and the ZMQ
sockets of its processes (`trace_rl.inference.vllm_engine`), the torchrun workers' private config (with the run's
credentials), their log and torchrun's own (`trace_rl.trainer.launcher`, `trace_rl.trainer.nodes`). Its user
removes it when done with it; what is left when the process exits is removed then, and what a process killed
outright (SIGKILL) left is removed by its reaper (`trace_rl.machine.reaper`), which finds the folders by the pid
in their names (`left_by`).

Standard library only: the reaper imports it.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile

PREFIX = "trace-rl-"


def make(kind: str) -> str:
    """A new folder of this process's for `kind` of files (a word: `vllm`, `workers`); removed at the latest when
    the process exits (by the process that made it, not by a child forked from it)."""
    owner = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{owner}-{kind}-")
    atexit.register(remove_at_exit, path, owner)
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def remove_at_exit(path: str, owner: int) -> None:
    if os.getpid() == owner:
        remove(path)


def left_by(pid: int) -> list[str]:
    """The folders that the process `pid` made and has not removed."""
    return glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{PREFIX}{pid}-*"))
