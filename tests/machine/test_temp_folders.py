"""A process's temp folders go with it when it exits: its own, not those of the process it was forked from.
(After a SIGKILL the reaper removes them: tests/machine/test_reaper.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trace_rl.machine import temp_folders

ROOT = Path(__file__).resolve().parents[2]
# a folder; a child forked from the process exits through its atexit handlers, inherited: the folder stays
EXITS = """
import os, sys
from trace_rl.machine import temp_folders
folder = temp_folders.make("test")
child = os.fork()
if child == 0:
    sys.exit(0)
os.waitpid(child, 0)
print(folder, os.path.isdir(folder), flush=True)
"""


def test_a_process_s_folders_go_when_it_exits_not_when_a_forked_child_does():
    process = subprocess.Popen([sys.executable, "-c", EXITS], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    folder, kept_after_the_child = out.split()
    assert Path(folder).name.startswith(f"trace-rl-{process.pid}-test-") and kept_after_the_child == "True"
    assert not Path(folder).exists() and temp_folders.left_by(process.pid) == []


def test_left_by_finds_the_folders_of_one_process_only(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    mine = temp_folders.make("a"), temp_folders.make("b")
    others = [f"trace-rl-{os.getpid()}7-a-xyz", "trace-rl-staging-abc"]  # another pid's; no process's
    for name in others:
        (tmp_path / name).mkdir()
    assert sorted(temp_folders.left_by(os.getpid())) == sorted(mine)
    for folder in mine:
        temp_folders.remove(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)
