"""The rows of a step's rollout table: a few rollouts as the model wrote them, for a person to read in the UI.

`[prefect.rollouts]` chooses `count` of the step's error-free traces (`select`):
  - groups: the groups in order, from each its best, its worst and one other at random, until `count` rows;
  - best / worst: the step's highest / lowest rewards (ties in trace order);
  - random: any `count`, in trace order.
The random choices are seeded by (run seed, step), so a step shows the same rollouts whenever it runs.

Each row: env, example, the policy step whose weights sampled it, the span of its sampled tokens' versions
(`policy_versions`: "3", or "2..3" for a rollout continued across steps under newer weights), the reward, the advantage (the mean `rl` value
over the trace's trained tokens, every `rl` channel summed as the trainer sees it; empty when no `rl` channel
trained the trace), the message the model answered (the one before its last turn; the tool results it answered,
marked `[tool result]`) and that last turn (its tool calls marked `[tool call]`).
Texts longer than `max_chars` are cut in the middle (how an answer starts and how it ends both tell), and every
secret the run knows of (`known_secrets`) is replaced by `[secret]` before the cut.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable

import numpy as np

from trace_rl import credentials
from trace_rl.config import Config, RolloutTableConfig
from trace_rl.data.channel import Channel
from trace_rl.data.trace import Message, Trace, group_traces
from trace_rl.envs.base import derive_seed
from trace_rl.pipeline.channels import combine

# the numbers before the texts: a long completion pushes the columns after it out of the UI's view
COLUMNS = ("env", "example", "policy_step", "policy_versions", "reward", "advantage", "prompt", "completion")
CUT = " [... {} characters cut ...] "


def rollout_rows(config: Config, step: int, traces: list[Trace], channels: list[Channel]) -> list[dict]:
    """The table of `step` as `[prefect.rollouts]` chooses it, with the secrets of `config` and the environment
    redacted."""
    options = config.prefect.rollouts
    secrets = known_secrets(config)
    chosen = choose(traces, options, random.Random(derive_seed(config.seed, step, "rollout-table")))
    advantages = rl_advantages(chosen, channels)
    return [row(trace, advantages.get(trace.id), options.max_chars, secrets) for trace in chosen]


def known_secrets(config: Config) -> set[str]:
    """What a run may know that nobody should read: the credentials in `storage_options` and in the envs' `args`
    (those under a credential key, e.g. a judge's `api_key`) and those in the environment."""
    envs = [*config.env, *(config.eval.envs if config.eval else [])]
    options = [config.storage_options, *(env.args for env in envs)]
    return credentials.secrets_in(options) | credentials.environment_secrets()


def choose(traces: list[Trace], options: RolloutTableConfig, rng: random.Random) -> list[Trace]:
    """`options.count` of the error-free traces, picked by `options.select`."""
    candidates = [trace for trace in traces if trace.error is None]
    count = min(options.count, len(candidates))
    if count == 0:
        return []
    if options.select == "best":
        return sorted(candidates, key=lambda t: -t.reward)[:count]
    if options.select == "worst":
        return sorted(candidates, key=lambda t: t.reward)[:count]
    if options.select == "random":
        picked = set(rng.sample(range(len(candidates)), count))
        return [trace for i, trace in enumerate(candidates) if i in picked]
    chosen: list[Trace] = []
    for group in group_traces(candidates).values():
        best = max(group, key=lambda t: t.reward)
        worst = min((t for t in group if t is not best), key=lambda t: t.reward, default=None)
        rest = [t for t in group if t is not best and t is not worst]
        other = rng.choice(rest) if rest else None
        chosen += [t for t in (best, worst, other) if t is not None][:count - len(chosen)]
        if len(chosen) == count:
            break
    return chosen


def rl_advantages(traces: list[Trace], channels: list[Channel]) -> dict[str, float]:
    """Per trace id: the mean of its summed `rl` values over the tokens they train, where any are trained."""
    wanted = {trace.id: trace for trace in traces}
    by_branch: dict[tuple[str, int], list[Channel]] = {}
    for channel in channels:
        if channel.loss == "rl" and channel.trace_id in wanted:
            by_branch.setdefault((channel.trace_id, channel.branch_index), []).append(channel)
    out: dict[str, float] = {}
    for trace_id, trace in wanted.items():
        trained = [combine(by_branch[(trace_id, b.index)], len(b)) for b in trace.branches
                   if (trace_id, b.index) in by_branch]
        values = np.concatenate([values[mask] for values, mask in trained]) if trained else np.zeros(0)
        if values.size:
            out[trace_id] = float(values.astype(np.float64).mean())
    return out


def row(trace: Trace, advantage: float | None, max_chars: int, secrets: Iterable[str]) -> dict:
    prompt, completion = last_exchange(trace.messages)
    return {"env": trace.env, "example": trace.example_id, "policy_step": trace.policy_step,
            "policy_versions": version_span(trace), "reward": round(trace.reward, 4), "advantage": None if advantage is None else round(advantage, 4),
            "prompt": shown(prompt, max_chars, secrets), "completion": shown(completion, max_chars, secrets)}


def version_span(trace: Trace) -> str:
    """The oldest and newest version of the trace's sampled tokens: "3", "2..3", or "" when it sampled none."""
    versions = [b.versions_or(trace.policy_step)[b.sampled] for b in trace.branches]
    versions = np.concatenate(versions) if versions else np.zeros(0, np.int32)
    if not versions.size:
        return ""
    low, high = int(versions.min()), int(versions.max())
    return str(low) if low == high else f"{low}..{high}"


def last_exchange(messages: list[Message]) -> tuple[str, str]:
    """(what the model answered in its last turn, that turn). What it answered is the message before the turn, or,
    when the turn answers tool results, every tool result since its previous turn, each marked `[tool result]` with
    its tool's name; a turn's tool calls follow its text, each marked `[tool call]` with its name and arguments."""
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
    if last is None:
        return (messages[-1].content if messages else ""), ""
    turn = messages[last]
    calls = [f"[tool call] {call.name} {json.dumps(call.arguments)}" for call in turn.tool_calls or []]
    first = last
    while first and messages[first - 1].role == "tool":
        first -= 1
    results = [f"[tool result]{f' {m.name}' if m.name else ''}: {m.content}" for m in messages[first:last]]
    answered = "\n".join(results) if results else (messages[last - 1].content if last else "")
    return answered, "\n".join([turn.content, *calls]).strip()


def shown(text: str, max_chars: int, secrets: Iterable[str]) -> str:
    """`text` with its secrets redacted, then cut in the middle to at most `max_chars` characters."""
    text = credentials.redact(text, secrets)
    if len(text) <= max_chars:
        return text
    keep = max_chars - len(CUT.format(len(text)))  # the marker's longest form: it counts fewer than len(text)
    head, tail = keep - keep // 3, keep // 3
    return text[:head] + CUT.format(len(text) - keep) + text[len(text) - tail:]
