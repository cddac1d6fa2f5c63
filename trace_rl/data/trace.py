"""The trace model: what a rollout produced, token for token.

A `Trace` is one agent's view of one rollout: its chat messages and one or more
`Branch`es. A branch is one root-to-leaf token sequence exactly as the model saw
it; multi-turn rollouts extend a branch turn by turn and start a new branch only
when the chat template cannot extend the previous tokens.

Per-token arrays of a branch (all the same length):
  token_ids      int32  the tokens
  sampled        bool   produced by the actor (everything else is prompt, template
                        scaffold or an environment observation)
  logprobs       float32 inference logprob of each sampled token, 0 elsewhere
  message_index  int32  index into `Trace.messages`, -1 for scaffold/generation prompts
  is_content     bool   message body (True) vs template scaffold (False)

A branch with `trainable = False` stays in the trace (its tokens are context, e.g. an
abandoned compaction attempt that verifiers marks so) but is never trained: the algorithm
runner takes no channel from it and validation refuses one that masks any of its tokens.

Algorithms annotate a branch with `advantages` (float32) and `mask` (bool);
None means "never assigned", which differs from zeros.

`policy_versions` (int32 per token, or None) records the weights step that sampled each token (0: the initial
model), -1 on tokens not sampled. A rollout cut and continued across steps (`[async] partial_rollout_tokens`)
holds tokens of several versions. None means "not recorded" (a branch built outside the rollout loop, e.g. by
an env or from foreign verifiers records): every sampled token was sampled by the trace's `policy_step`
(`Branch.versions_or` fills them in so).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

TOKEN_ARRAYS = {
    "token_ids": np.int32,
    "sampled": np.bool_,
    "logprobs": np.float32,
    "message_index": np.int32,
    "is_content": np.bool_,
}
ANNOTATIONS = {"advantages": np.float32, "mask": np.bool_}
POLICY_VERSIONS = "policy_versions"
NOT_SAMPLED = -1  # the version of a token no policy sampled


class TraceError(ValueError):
    """A trace or branch that breaks the trace model's invariants."""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    name: str
    arguments: dict[str, Any] = {}


class Message(BaseModel):
    """One chat message. Tool results carry the tool `name` (or a `tool_call_id`)."""

    model_config = ConfigDict(extra="forbid")
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


@dataclass(eq=False)
class Branch:
    token_ids: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray
    message_index: np.ndarray
    is_content: np.ndarray
    index: int = 0
    temperature: float = 1.0
    trainable: bool = True
    advantages: np.ndarray | None = None
    mask: np.ndarray | None = None
    policy_versions: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name, dtype in TOKEN_ARRAYS.items():
            setattr(self, name, np.asarray(getattr(self, name), dtype=dtype))
        lengths = {name: len(getattr(self, name)) for name in TOKEN_ARRAYS}
        if self.policy_versions is not None:
            self.policy_versions = np.asarray(self.policy_versions, dtype=np.int32)
            lengths[POLICY_VERSIONS] = len(self.policy_versions)
            if len(set(lengths.values())) == 1 and np.any((self.policy_versions >= 0) != self.sampled):
                raise TraceError(f"branch {self.index}: policy_versions must be >= 0 exactly on sampled tokens "
                                 f"({NOT_SAMPLED} elsewhere)")
        if len(set(lengths.values())) != 1:
            raise TraceError(f"branch {self.index}: per-token arrays differ in length: {lengths}")
        self.index = int(self.index)
        self.temperature = float(self.temperature)
        self.trainable = bool(self.trainable)
        if not self.temperature > 0:
            raise TraceError(f"branch {self.index}: temperature must be > 0, got {self.temperature}")

    def __len__(self) -> int:
        return len(self.token_ids)

    def versions_or(self, policy_step: int) -> np.ndarray:
        """`policy_versions`, or where not recorded, `policy_step` on every sampled token."""
        if self.policy_versions is not None:
            return self.policy_versions
        return np.where(self.sampled, np.int32(policy_step), np.int32(NOT_SAMPLED)).astype(np.int32)

    def clear_annotations(self) -> None:
        self.advantages = None
        self.mask = None

    def equals(self, other: Branch) -> bool:
        if (self.index, self.temperature, self.trainable) != (other.index, other.temperature, other.trainable):
            return False
        for name in (*TOKEN_ARRAYS, *ANNOTATIONS, POLICY_VERSIONS):
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or not np.array_equal(a, b)):
                return False
        return True


@dataclass(eq=False)
class Trace:
    id: str
    env: str
    example_id: str
    group_id: str
    branches: list[Branch] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    agent: str = "policy-agent"
    trainable: bool = True
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # the weights step that sampled it (0: the initial model); for a rollout continued across steps, the weights
    # that sampled its last token (each token's own: `Branch.policy_versions`)
    policy_step: int = 0

    def __post_init__(self) -> None:
        self.messages = [m if isinstance(m, Message) else Message(**m) for m in self.messages]
        self.reward = float(self.reward)
        if not math.isfinite(self.reward):
            raise TraceError(f"trace {self.id}: reward must be finite, got {self.reward}")
        self.rewards = {k: float(v) for k, v in self.rewards.items()}
        self.metrics = {k: float(v) for k, v in self.metrics.items()}
        for position, branch in enumerate(self.branches):
            if branch.index != position:
                raise TraceError(f"trace {self.id}: branch at position {position} has index {branch.index}")
            bad = branch.message_index[branch.message_index >= len(self.messages)]
            if bad.size:
                raise TraceError(
                    f"trace {self.id} branch {position}: message_index {int(bad[0])} "
                    f"out of range for {len(self.messages)} messages"
                )

    @property
    def ok(self) -> bool:
        """Trainable and error-free: the only traces any builtin algorithm trains."""
        return self.trainable and self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "env": self.env,
            "example_id": self.example_id,
            "group_id": self.group_id,
            "agent": self.agent,
            "trainable": self.trainable,
            "reward": self.reward,
            "rewards": self.rewards,
            "metrics": self.metrics,
            "info": self.info,
            "messages": [m.model_dump(exclude_none=True) for m in self.messages],
            "error": self.error,
            "policy_step": self.policy_step,
            "branches": [_branch_to_dict(b) for b in self.branches],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        data = dict(data)
        branches = [_branch_from_dict(b) for b in data.pop("branches", [])]
        return cls(branches=branches, **data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Trace:
        return cls.from_dict(json.loads(text))

    def equals(self, other: Trace) -> bool:
        mine, theirs = self.to_dict(), other.to_dict()
        mine.pop("branches"), theirs.pop("branches")
        return (
            mine == theirs
            and len(self.branches) == len(other.branches)
            and all(a.equals(b) for a, b in zip(self.branches, other.branches))
        )


def _branch_to_dict(branch: Branch) -> dict[str, Any]:
    out: dict[str, Any] = {"index": branch.index, "temperature": branch.temperature}
    if not branch.trainable:  # written only when false: a trainable branch's dict is what it was before the field
        out["trainable"] = False
    for name in (*TOKEN_ARRAYS, *ANNOTATIONS):
        value = getattr(branch, name)
        out[name] = None if value is None else value.tolist()
    if branch.policy_versions is not None:  # written only when recorded, like `trainable`
        out[POLICY_VERSIONS] = branch.policy_versions.tolist()
    return out


def _branch_from_dict(data: dict[str, Any]) -> Branch:
    data = dict(data)
    for name, dtype in ANNOTATIONS.items():
        if data.get(name) is not None:
            data[name] = np.asarray(data[name], dtype=dtype)
    return Branch(**data)


def rollout_trace_id(group_id: str, rollout: int, agent: str, repeat: int = 0) -> str:
    """The id the rollout loop gives a trace: `<group_id>-r<rollout>-<agent>`, then `-<repeat>` for the agent's
    further traces of one rollout (repeat 1, 2, ...: a seat that plays several times, as a proposer's solvers)."""
    return f"{group_id}-r{rollout}-{agent}" + (f"-{repeat}" if repeat else "")


def rollout_of(trace: Trace) -> str | None:
    """`<group_id>-r<rollout>`: the rollout (episode) a trace came from, read from its id (`rollout_trace_id`);
    None for a trace whose id the rollout loop did not build (replayed records)."""
    prefix = f"{trace.group_id}-r"
    number, dash, _ = trace.id.removeprefix(prefix).partition("-")
    return f"{prefix}{number}" if trace.id.startswith(prefix) and number.isdecimal() and dash else None


def group_traces(traces: list[Trace]) -> dict[str, list[Trace]]:
    """Traces by `group_id`, in first-seen order (a group: all rollouts of one example of one env)."""
    groups: dict[str, list[Trace]] = {}
    for trace in traces:
        groups.setdefault(trace.group_id, []).append(trace)
    return groups
