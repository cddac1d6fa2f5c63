"""A process that keeps the memory it frees touches no fresh pages for a step's tensors the second time round; one
that does not faults them in again each time. Each case runs in a process of its own (the setting is the process's)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# a step's worth of tensors (64 KB to 143 MB, 316 MB in all) made, written and freed, eight times: the minor page
# faults of each round
ROUNDS = """
import json, resource, sys, torch
{setup}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sizes = [2**14 * 3**i for i in range(8)] + [24 * 2**20]
counts = []
for _ in range(8):
    before = faults()
    tensors = [torch.empty(n).fill_(1.0) for n in sizes]
    del tensors
    counts.append(faults() - before)
print(json.dumps({{"faults": counts, "pages": sum(sizes) * 4 // 4096, "why": why}}))
"""
KEEP = "from trace_rl.machine.freed_memory import keep_freed_memory\nwhy = keep_freed_memory()"
DEFAULTS = "why = None"
TRAINER = """
from trace_rl.config import Config
from trace_rl.storage import RunStorage
from trace_rl.trainer.trainer import Trainer
from trace_rl.machine.freed_memory import keep_freed_memory
config = Config(name="run", storage=sys.argv[2], env=[{"id": "synthetic"}], model={"name": sys.argv[1]},
                inference={"max_model_len": 64}, trainer={"device": "cpu", "micro_batch_tokens": 64})
Trainer(config, RunStorage.of(config))
why = keep_freed_memory() if keep_freed_memory.cache_info().currsize else None  # the trainer called it
"""


def rounds(setup: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ROUNDS.format(setup=setup), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_kept_memory_is_reused_without_page_faults():
    kept, defaults = rounds(KEEP), rounds(DEFAULTS)
    assert kept["why"].startswith("glibc's malloc keeps freed memory")
    assert kept["faults"][0] > kept["pages"] / 2  # the first round touches its pages once
    assert max(kept["faults"][5:]) < kept["pages"] / 100, kept
    # glibc's defaults give the largest blocks back (mmap) and fault them in again every round
    assert min(defaults["faults"][5:]) > kept["pages"] / 3, defaults


def test_a_cpu_trainer_s_process_keeps_its_freed_memory(tiny_model_path, tmp_path):
    result = rounds(TRAINER, tiny_model_path, str(tmp_path / "runs"))
    assert result["why"].startswith("glibc's malloc keeps freed memory")
    # threads of the trainer's process that allocate now and then may fault a round's pages (28 MB of one round
    # once on an AMX Xeon); glibc's defaults fault a third of them in every round
    quiet = [count for count in result["faults"][4:] if count < result["pages"] / 100]
    assert len(quiet) >= 3, result
