"""Token age: how far behind the weights a step trains from each sampled token was sampled, and the bound on it.

Step n trains from the weights of step n - 1, so a token sampled by the weights of step v has age

    age = n - 1 - v        (0: on-policy)

The schedule of `[async] max_off_policy_steps = k` samples step n with the weights v(n) = max(0, n - 1 - k)
(trace_rl.pipeline.schedule), so a token sampled at step n has age k at most. A rollout continued across steps
(`[async] partial_rollout_tokens`) keeps the tokens earlier steps sampled, with older weights. `[async]
max_token_age = a` bounds those (`Config.token_age_bound`; unset, k + s for rollouts of up to s segments: up to k
old when sampled, up to s - 1 steps more until its rollout ended, and one step an ended group may wait): a token
with

    age > a,    that is    v < n - 1 - a,

is stale. `[async] stale_tokens` decides what happens to it: 'mask' leaves it out of every loss (`mask_stale`;
the rollout's other tokens still train), 'drop' drops its whole rollout (`drop_stale`: its traces get an error
and never train). Without partial rollouts no token is stale. The behaviour policy of every token is its own
sampler logprob (`inference_logprobs`), whatever its age.
"""

from __future__ import annotations

import numpy as np

from trace_rl.data.sample import TrainingSample
from trace_rl.data.trace import Trace


def oldest_version(step: int, max_age: int) -> int:
    """The oldest weights a token step `step` trains may have been sampled by: step - 1 - max_age."""
    return step - 1 - max_age


def stale(versions: np.ndarray, sampled: np.ndarray, step: int, max_age: int) -> np.ndarray:
    """Per token: sampled by weights older than `oldest_version`."""
    return sampled & (versions < oldest_version(step, max_age))


def token_ages(trace: Trace, step: int) -> np.ndarray:
    """The ages at step `step` of the trace's sampled tokens, branch after branch."""
    ages = [step - 1 - b.versions_or(trace.policy_step)[b.sampled] for b in trace.branches]
    return np.concatenate(ages).astype(np.int64) if ages else np.zeros(0, np.int64)


def age_metrics(traces: list[Trace], step: int) -> dict[str, float]:
    """`async/token_age_mean` and `async/token_age_max` over the sampled tokens of the step's error-free traces."""
    ages = [token_ages(t, step) for t in traces if t.error is None]
    ages = np.concatenate(ages) if ages else np.zeros(0, np.int64)
    return {"async/token_age_mean": float(ages.mean()) if ages.size else 0.0,
            "async/token_age_max": float(ages.max()) if ages.size else 0.0}


def drop_stale(rollouts: list[list[Trace]], step: int, max_age: int) -> int:
    """Mark every trace of each rollout holding a stale token with an error (never trained, kept in
    traces.parquet); returns how many rollouts were dropped."""
    dropped = 0
    oldest = oldest_version(step, max_age)
    for traces in rollouts:
        if any(stale(b.versions_or(t.policy_step), b.sampled, step, max_age).any()
               for t in traces if t.error is None for b in t.branches):
            dropped += 1
            for trace in traces:
                trace.error = (f"dropped for age: a token sampled by weights older than step {oldest}, more "
                               f"than {max_age} steps before the weights step {step} trains from ([async] "
                               "max_token_age)")
    return dropped


def mask_stale(samples: list[TrainingSample], step: int, max_age: int) -> int:
    """Take the stale tokens out of every loss mask of the samples (in place); returns how many trained tokens
    that masked."""
    masked = 0
    for sample in samples:
        if sample.policy_versions is None:
            continue
        old = stale(sample.policy_versions, sample.sampled, step, max_age)
        if not old.any():
            continue
        masked += int(np.count_nonzero(old & (sample.rl_mask | sample.ce_mask)))
        sample.rl_mask = sample.rl_mask & ~old  # new arrays: a mask may be a channel's own
        sample.ce_mask = sample.ce_mask & ~old
    return masked
