"""A run whose storage fills up mid-checkpoint: the write fails with a clear error, the previous checkpoint
stays STABLE, nothing torn is left marked complete, and once there is room `--resume` ends bitwise-identical.

The storage is a 10 MiB tmpfs mounted in a private mount namespace (`unshare -rm`): one step of the suite's
run writes ~7 MiB (a 5 MiB checkpoint, 1.7 MiB of weights), so step 2's checkpoint runs out of room."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.bitwise import difference
from tests.faults.conftest import write_config
from tests.flows.test_crash_resume import ROOT

pytestmark = [pytest.mark.faults, pytest.mark.slow]

SCRIPT = """
set -u
mount -t tmpfs -o size=10m tmpfs {runs}
{train}; echo $? > {out}/full.rc
find {runs} -name STABLE -o -name '*.safetensors' -o -name optimizer.pt | sort > {out}/after-full.txt
mount -o remount,size=64m {runs}
{train} --resume; echo $? > {out}/resumed.rc
cp {runs}/disk-full/weights/000003/model.safetensors {out}/
"""


def can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs user namespaces to mount a small tmpfs (unshare -rm)")
def test_a_full_disk_fails_the_step_clearly_and_resume_finishes_it(prefect_api, tmp_path, uninterrupted):
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    out.mkdir()
    config = write_config(tmp_path, "disk-full", str(runs))
    train = f"{shlex.quote(sys.executable)} -m flows.cli train {shlex.quote(str(config))}"
    done = subprocess.run(["unshare", "-rm", "sh", "-c", SCRIPT.format(runs=runs, train=train, out=out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    log = done.stdout + done.stderr
    assert (out / "full.rc").read_text() == "1\n", log[-3000:]
    # step 2's checkpoint (in the background), its weights and its JSON files are written at once: whichever meets
    # the full disk first fails the step; the checkpoint (5 MiB in the 3 MiB left) never fits, the weights may
    run = f"{runs}/disk-full"
    step_two = r"(checkpoints/000002|weights/000002|steps/000002/\w+\.json)"
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(
        rf"error: no room to write {re.escape(run)}/{step_two}: No space left on device\. It is "
        "not marked complete and the run's last STABLE checkpoint is untouched", errors[0]), log[-3000:]
    # after the failure: step 1 complete; of step 2's checkpoint nothing is left (its partial copy removed); its
    # weights are whole or absent (the resume rewrites them)
    step_one = [f"{run}/checkpoints/000001/STABLE", f"{run}/checkpoints/000001/optimizer.pt",
                f"{run}/weights/000001/STABLE", f"{run}/weights/000001/model.safetensors"]
    step_two_weights = [f"{run}/weights/000002/STABLE", f"{run}/weights/000002/model.safetensors"]
    assert (out / "after-full.txt").read_text().split() in (step_one, step_one + step_two_weights)
    assert (out / "resumed.rc").read_text() == "0\n", log[-3000:]
    assert (why := difference((out / "model.safetensors").read_bytes(), uninterrupted)) is None, why
