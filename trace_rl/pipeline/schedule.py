"""Which weights sample which step: the fixed schedule of `[async] max_off_policy_steps`.

With k = `max_off_policy_steps`, step n (numbered from 1) samples with the weights saved after step

    v(n) = max(0, n - 1 - k)        (0: the initial model)

so k = 0 is the synchronous pipeline (step n samples with the weights of step n - 1) and with
k >= 1 the sampling of steps n + 1 .. n + k may run while step n trains: their weights,
v(n + k) = n - 1 at the latest, are saved before step n starts. The schedule depends on the
config alone, never on timing, which keeps runs, resumes and replays bitwise reproducible.
"""

from __future__ import annotations

from trace_rl.data.trace import Trace


class StaleTraceError(RuntimeError):
    """A trace was sampled with weights older than the schedule allows for the step that would train on it."""


def sampling_weights(step: int, max_off_policy_steps: int) -> int:
    """v(n): the step whose saved weights sample step `step` (0: the initial model)."""
    return max(0, step - 1 - max_off_policy_steps)


def sampled_while_training(step: int, max_off_policy_steps: int, sampled_upto: int, last_step: int) -> list[int]:
    """The steps to sample while step `step` trains: after `sampled_upto`, up to step + k (and the run's last step);
    each one's weights v(m) <= step - 1 exist by then."""
    return list(range(sampled_upto + 1, min(step + max_off_policy_steps, last_step) + 1))


def check_staleness(traces: list[Trace], step: int, max_off_policy_steps: int) -> None:
    """StaleTraceError unless every trace of step `step` was sampled with weights v(step) or newer."""
    oldest_allowed = sampling_weights(step, max_off_policy_steps)
    stale = [t for t in traces if t.policy_step < oldest_allowed]
    if stale:
        raise StaleTraceError(
            f"step {step}: {len(stale)} trace(s) (first {stale[0].id!r}) were sampled with the weights of step "
            f"{min(t.policy_step for t in stale)}, more than [async] max_off_policy_steps = {max_off_policy_steps} "
            f"versions behind step {step - 1}: they are not trained on")


def lag_metrics(traces: list[Trace], step: int) -> dict[str, float]:
    """How far behind the synchronous schedule (weights of step - 1) the step's traces were sampled."""
    lags = [step - 1 - t.policy_step for t in traces] or [0]
    return {"async/policy_step": float(min(t.policy_step for t in traces)) if traces else 0.0,
            "async/policy_lag_mean": sum(lags) / len(lags), "async/policy_lag_max": float(max(lags))}
