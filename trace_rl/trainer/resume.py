"""Which step a trainer may train next, given the step of the checkpoint it restored (None: the base model)."""

from __future__ import annotations


class TrainerError(RuntimeError):
    pass


def check_resumes_at(restored: int | None, step: int) -> None:
    """A step trains on the state after the step before it: that step's checkpoint, or the base model at the first
    step (never on top of a later state)."""
    if restored is not None and restored >= step:
        raise TrainerError(
            f"checkpoint for step {restored} already exists; step {step} would train on top of a later state. "
            f"Delete the newer checkpoints or resume from step {restored + 1}"
        )
    if (restored is not None or step > 1) and restored != step - 1:
        raise TrainerError(
            f"step {step} trains on the state after step {step - 1}, but the latest checkpoint is "
            f"{'none' if restored is None else 'of step ' + str(restored)}; resume the run (it re-runs the steps "
            "after its newest checkpoint)")
