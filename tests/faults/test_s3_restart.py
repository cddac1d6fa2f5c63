"""The S3 server dies in the middle of a batch write and of a checkpoint write, and comes back: nothing torn
is read as complete, and the run (riding out the outage, or resumed once it failed) ends bitwise-identical."""

from __future__ import annotations

import time

import pytest

from tests.bitwise import weights_difference
from tests.faults.conftest import write_config
from tests.flows.test_crash_resume import finish, output, start
from trace_rl.storage import RunStorage

pytestmark = [pytest.mark.faults, pytest.mark.slow]

DOWN_S = 3.0


def died(server, process) -> list[str]:
    """Wait until the S3 server, started with `die_at`, has killed itself; what it had received by then."""
    deadline = time.monotonic() + 300
    while server.process.poll() is None:
        assert process.poll() is None, f"the run ended before the S3 server died: {output(process)[-3000:]}"
        assert time.monotonic() < deadline, "the S3 server did not die within 300 s"
        time.sleep(0.01)
    server.drop_half_written_entry()
    return server.requests()


def test_s3_killed_mid_batch_and_mid_checkpoint_write_then_back(prefect_api, tmp_path, durable_s3, uninterrupted_run):
    name = "s3-faults"
    options = {"client_kwargs": {"endpoint_url": durable_s3.endpoint}}
    config = write_config(tmp_path, name, "s3://faults", storage_options=options)
    storage = RunStorage("s3://faults", name, options)
    put = f"PUT /faults/{name}"

    def settled(process, done) -> bool:
        """Wait until the run has ended or `done()` (it got past the outage); True if it is still running."""
        while process.poll() is None and not done():
            time.sleep(0.05)
            storage.fs.invalidate_cache()
        return process.poll() is None

    outcomes = []
    durable_s3.kill()
    # batch.parquet goes to a temporary name first, then is copied into place
    durable_s3.start(die_at=f"{put}/steps/000002/.tmp-")
    process = start(config)
    seen = died(durable_s3, process)
    time.sleep(DOWN_S)
    durable_s3.start(die_at=f"{put}/checkpoints/000003/")  # the same port, the objects it had accepted
    assert not any(s.startswith(f"{put}/steps/000002/batch.parquet") for s in seen)
    if not settled(process, lambda: storage.is_stable(storage.path("checkpoints", "000002"))) and process.returncode:
        outcomes.append("batch write: the run failed")
        assert not storage.exists(storage.step_path(2, "batch.parquet"))
        assert storage.stable_steps("checkpoints") == [1]
        process = start(config, "--resume")
    else:
        outcomes.append("batch write: the run rode it out")

    seen = died(durable_s3, process)
    time.sleep(DOWN_S)
    durable_s3.start()
    assert not any(s.startswith(f"{put}/checkpoints/000003/STABLE") for s in seen)
    process.wait(timeout=600)
    storage.fs.invalidate_cache()
    if process.returncode:
        outcomes.append("checkpoint write: the run failed")
        assert storage.stable_steps("checkpoints") == [1, 2] and storage.stable_steps("weights") == [1, 2]
        finish(start(config, "--resume"))
    else:
        outcomes.append("checkpoint write: the run rode it out")
    storage.fs.invalidate_cache()
    print("; ".join(outcomes))
    assert storage.stable_steps("weights") == [1, 2, 3], outcomes  # [ckpt] keep_weights_every = 1
    assert (why := weights_difference(storage, uninterrupted_run)) is None, f"{why}; {outcomes}"
