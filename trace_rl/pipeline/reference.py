"""The `[trainer.loss.kl]` reference's logprobs of a step's training samples, scored once per step.

The batch's stage (`trace_rl.pipeline.step.write_batch`, a replay's too) asks the reference's
runtime to score each sample's tokens, as `opd` scores a branch, and the logprobs travel to the
trainer in the batch's `ref_logprobs` column. A sample is scored at its own temperature, the
divisor the trainer's logprobs of its sampled tokens use (docs/trainer.md).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from trace_rl.aio import gather_or_cancel
from trace_rl.config import Config
from trace_rl.data.sample import TrainingSample


class ReferenceScoringError(RuntimeError):
    """The reference returned logprobs that do not line up with a sample's tokens."""


def reference_key(config: Config) -> str | None:
    """The model key the KL penalty scores with, or None without `[trainer.loss.kl]`."""
    kl = config.trainer.loss.kl
    return None if kl is None else kl.model


async def score_samples(runtime, samples: list[TrainingSample], max_concurrent: int) -> list[TrainingSample]:
    """The samples with `ref_logprobs` set to `runtime`'s logprobs of their tokens (at most `max_concurrent`
    calls at once, round-robin over the runtime's endpoints, in sample order)."""
    limit = asyncio.Semaphore(max_concurrent)
    endpoints = max(1, getattr(runtime, "num_endpoints", 1))

    async def one(index: int, sample: TrainingSample) -> TrainingSample:
        async with limit:
            scored = await runtime.score(sample.input_ids.tolist(), temperature=float(sample.temperature),
                                         endpoint=index % endpoints)
        scored = np.asarray(scored, dtype=np.float32)
        if scored.shape != (len(sample),):
            raise ReferenceScoringError(f"the KL reference returned {scored.shape[0]} logprobs for trace {sample.trace_id!r} "
                                 f"branch {sample.branch_index} of {len(sample)} tokens")
        return dataclasses.replace(sample, ref_logprobs=scored)

    return await gather_or_cancel(one(i, s) for i, s in enumerate(samples))


async def with_reference_logprobs(session, step: int, samples: list[TrainingSample]) -> list[TrainingSample]:
    """`samples` scored by the run's KL reference; unchanged without `[trainer.loss.kl]` (nothing is built)."""
    key = reference_key(session.config)
    if key is None or not samples:
        return samples
    runtime = (await session.models_for(step, {key}))[key]
    return await score_samples(runtime, samples, session.config.inference.max_concurrent)
