"""`ckpt.interval` through the train flow: a resume re-runs the steps after the newest checkpoint, bitwise."""

from __future__ import annotations

from tests.bitwise import weights_difference
from tests.flows.conftest import small_config
from tests.flows.test_pipeline import step_runs
from trace_rl.pipeline import session
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage


def test_resume_reruns_the_steps_after_the_newest_checkpoint_bitwise(prefect_api, tmp_path):
    from flows.train import run_training

    def config(name: str, steps: int):
        ckpt = {"interval": 2, "keep": 2, "keep_weights_every": 0}  # weights pruned like checkpoints
        return validate_config(small_config(str(tmp_path), name, steps=steps, ckpt=ckpt))

    run_training(config("straight", 4))
    straight = RunStorage(str(tmp_path), "straight")
    assert straight.stable_steps("checkpoints") == [2, 4] and straight.stable_steps("weights") == [2, 3, 4]

    # what a SIGKILL during step 4 of a 4-step run leaves: checkpoint 2, weights 2 and 3, and every stage of
    # step 3 finished (its train task's result recorded too); the checkpoint of step 3 exists only because
    # 3 was the last step of this shorter run
    run_training(config("killed", 3))
    killed = RunStorage(str(tmp_path), "killed")
    killed.remove(killed.path("checkpoints", "000003"))
    assert killed.stable_steps("checkpoints") == [2] and killed.stable_steps("weights") == [2, 3]
    session._SESSIONS.clear()  # a new process: nothing warm

    run_training(config("killed", 4), resume=True)
    assert (why := weights_difference(killed, straight, 4)) is None, why
    assert killed.stable_steps("checkpoints") == [2, 4] and killed.stable_steps("weights") == [2, 3, 4]
    rerun = [run for run in step_runs(prefect_api, "killed") if run["name"] == "killed-step-3"][-1]
    tasks = dict(rerun["tasks"])
    # the sampled traces and batch of step 3 are reused; the trainer trains step 3 again from checkpoint 2
    assert tasks["sample_rollouts"] == "Cached" and tasks["write_batch"] == "Cached"
    assert tasks["train"] == "Completed"
