"""Dimension validation: every channel checked against its branch before anything is aggregated or written.

Rules (each failure names the env, trace id, branch index, algorithm id and what is wrong):
  - the channel's branch exists; the loss is one the trainer knows (`rl`, `ce`);
  - values (float) and mask (bool) have exactly the branch's token count; values are finite in float32;
  - mask is never true at position 0 (the first token has no logprob: nothing precedes it);
  - an `rl` channel masks only tokens the actor sampled, of a trainable trace;
  - no channel masks a token of an untrainable branch (`Branch.trainable = False`).
"""

from __future__ import annotations

import numpy as np

from trace_rl.data.channel import Channel
from trace_rl.data.trace import Branch, Trace
from trace_rl.names import LOSS_NAMES


class DimensionError(ValueError):
    """A channel that does not fit its branch."""


def validate_channels(traces: list[Trace], channels: list[Channel], *, source: str | None = None) -> None:
    """Raise DimensionError on the first channel breaking a rule; `source` (e.g. a remote server's URL)
    prefixes the message so replies from elsewhere are named."""
    branches = {(trace.id, branch.index): (trace, branch) for trace in traces for branch in trace.branches}
    envs = {trace.id: trace.env for trace in traces}

    def fail(channel: Channel, what: str) -> DimensionError:
        where = (
            f"env {envs.get(channel.trace_id, '?')!r} trace {channel.trace_id!r} branch {channel.branch_index} "
            f"algorithm {channel.algorithm_id!r}"
        )
        return DimensionError(f"{source}: {where}: {what}" if source else f"{where}: {what}")

    located: list[tuple[Channel, Trace, Branch]] = []
    for channel in channels:
        found = branches.get((channel.trace_id, channel.branch_index))
        if found is None:
            what = "no such trace" if channel.trace_id not in envs else "the trace has no such branch"
            raise fail(channel, what)
        trace, branch = found
        values, mask, tokens = channel.values, channel.mask, len(branch.token_ids)
        fits = (
            type(values) is np.ndarray and type(mask) is np.ndarray and values.shape == mask.shape == (tokens,)
            and values.dtype.kind == "f" and mask.dtype == np.bool_ and channel.loss in LOSS_NAMES
        )
        if not fits:  # the slow path names what does not fit
            check_shape(channel, branch, fail)
        if tokens and mask[0]:
            raise fail(channel, "mask is true at token 0, which has no logprob (nothing precedes it)")
        if not branch.trainable and mask.any():
            raise fail(channel, "channel masks tokens of an untrainable branch (trainable = false): it is context, "
                                "never a training sample")
        if channel.loss == "rl" and not trace.trainable and mask.any():
            raise fail(channel, "rl channel masks tokens of an untrainable trace (trainable = false)")
        located.append((channel, trace, branch))

    with np.errstate(over="ignore"):  # float64 values beyond float32's range become inf: reported below
        if located and not np.isfinite(np.concatenate([c.values for c, _, _ in located], dtype=np.float32)).all():
            for channel, _, _ in located:
                values = channel.values.astype(np.float32)
                if not np.isfinite(values).all():
                    position = int(np.flatnonzero(~np.isfinite(values))[0])
                    raise fail(channel, f"value at token {position} is {channel.values[position]} "
                                        f"({values[position]} in float32); values must be finite in float32")

    rl = [(c, b) for c, _, b in located if c.loss == "rl"]
    if rl and (np.concatenate([c.mask for c, _ in rl]) & ~np.concatenate([b.sampled for _, b in rl])).any():
        for channel, branch in rl:
            unsampled = np.flatnonzero(channel.mask & ~branch.sampled)
            if unsampled.size:
                raise fail(channel, f"rl mask covers token {int(unsampled[0])}, which the actor did not sample; "
                                    "rl trains only sampled tokens (use a 'ce' algorithm for observations)")


def check_shape(channel: Channel, branch: Branch, fail) -> None:
    if channel.loss not in LOSS_NAMES:
        raise fail(channel, f"loss {channel.loss!r} is unknown to the trainer (known: {', '.join(LOSS_NAMES)})")
    tokens = len(branch)
    for name, kind in (("values", "f"), ("mask", "b")):
        array = getattr(channel, name)
        if not isinstance(array, np.ndarray) or array.shape != (tokens,):
            shape = array.shape if isinstance(array, np.ndarray) else type(array).__name__
            raise fail(channel, f"{name} has shape {shape} but the branch has {tokens} tokens")
        if array.dtype.kind != kind:
            expected = "floating point" if kind == "f" else "bool"
            raise fail(channel, f"{name} has dtype {array.dtype}; expected {expected}")
