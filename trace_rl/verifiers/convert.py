"""verifiers v1 traces to trace-rl traces and back, token for token.

A `vf.Trace` is a message graph: each node holds one message and the tokens it adds to the sequence (its
leading template scaffold and its own tokens; an assistant node the generation prompt, then the sampled
completion), with per-token `mask` (sampled) and `is_content`, and `logprobs` of its sampled tokens only. A
branch is a root-to-leaf path. A trace-rl `Trace` holds the messages once and, per branch, per-token arrays.

  verifiers v1                           trace-rl
  `trace.branches`, in order             `branches`; `Branch.trainable` as verifiers derives it
  concat(node.token_ids) along a path    `token_ids`
  concat(node.mask)                      `sampled`
  node.logprobs, on the sampled tokens   `logprobs` (0 elsewhere)
  the path's nodes                       `message_index`: one message per (depth in the conversation, message),
                                         so a message several branches share is one entry; -1 for an assistant
                                         node's tokens before its first sampled one (the generation prompt)
  node.is_content                        `is_content` (a node without it: its sampled tokens are the content)
  the branch's calls' temperature        `temperature` (else the agent's sampling temperature, else 1.0)
  agent.name, agent.trainable            `agent`, `trainable`
  Σ score·weight, {name: score}          `reward`, `rewards`
  metrics (None: not scored, dropped)    `metrics`
  ok = false                             `error`: the last error as "Type: message", else the stop condition
  task.data.idx (else its id, key)       `example_id`; the taskset (`task.type`) is the default `env`

The way back (`vf_from_trace`) writes trace-rl's fields verifiers has no place for under `info["trace_rl"]`
(env, example and group ids, policy step, the replay step, the exact error, and the per-token versions: `policy`,
the episode's version span as verifiers' `PolicySpan` (start: the oldest version of a sampled token, end: the
newest), and `policy_versions`, one list per branch, where the branches record them), which `trace_from_vf`
reads back;
a message's scaffold tokens that belong to no message (-1) join the next message's node, so they come back
attributed to that message (with `is_content` false) unless they are a generation prompt. An untrainable
branch is written as verifiers writes one: a leaf marked as an unaccepted compaction attempt.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from trace_rl.data.trace import Branch, Message, ToolCall, Trace, TraceError

if TYPE_CHECKING:
    import verifiers.v1 as vf

TRACE_RL_INFO = "trace_rl"  # the key of `vf.Trace.info` that holds trace-rl's own fields
ERROR_TYPE = re.compile(r"^([A-Za-z_][\w.]*): (.*)$", re.DOTALL)


class ConversionError(ValueError):
    """A trace the other side's model cannot hold; the message names the trace and what does not fit."""


# -- verifiers -> trace-rl ------------------------------------------------------------------------------------


def vf_task_id(vf_trace: vf.Trace) -> str:
    """The task's identity within its taskset: `task.data.idx`, else the data's own `id`, else `task.key`/`hash`."""
    data = vf_trace.task.data
    for value in (data.idx, data.id, vf_trace.task.key, vf_trace.task.hash):
        if value is not None:
            return str(value)
    raise ConversionError(f"trace {vf_trace.id}: its task has no idx, id, key or hash to group its rollouts by")


def untokenized(vf_trace: vf.Trace) -> bool:
    """Whether the trace has a sampled turn without token ids (sampled through an eval client: text only)."""
    return any(node.sampled and not node.token_ids for node in vf_trace.nodes)


def trace_from_vf(vf_trace: vf.Trace, *, env: str | None = None, example_id: str | None = None,
                  group_id: str | None = None, trace_id: str | None = None,
                  policy_step: int | None = None) -> Trace:
    """The trace-rl trace of `vf_trace` (see the module's table). Each id left None comes from what a trace-rl
    export stored in `info["trace_rl"]`, else: `env` the taskset (`task.type`), `example_id` `vf_task_id`,
    `group_id` "<env>/<example_id>", `trace_id` the trace's id, `policy_step` 0. ConversionError when a node's
    arrays disagree in length, a sampled turn has no token ids, or a branch was sampled at several temperatures."""
    info = dict(vf_trace.info)
    saved = info.pop(TRACE_RL_INFO, None) or {}
    env = env if env is not None else saved.get("env", vf_trace.task.type)
    example_id = example_id if example_id is not None else saved.get("example_id", vf_task_id(vf_trace))
    group_id = group_id if group_id is not None else saved.get("group_id", f"{env}/{example_id}")
    if untokenized(vf_trace):
        raise ConversionError(f"trace {vf_trace.id}: a sampled turn has no token ids (sampled through an eval "
                              "client, which returns text only); trace-rl trains on token ids")
    message_of, messages = _messages(vf_trace)
    has_tokens = any(node.token_ids for node in vf_trace.nodes)
    versions = saved.get("policy_versions") or [None] * len(vf_trace.branches)
    if len(versions) != len(vf_trace.branches):
        raise ConversionError(f"trace {vf_trace.id}: info.trace_rl.policy_versions holds {len(versions)} lists for "
                              f"{len(vf_trace.branches)} branches")
    try:
        branches = [_branch(vf_trace, branch, path, message_of, branch_versions)
                    for branch, path, branch_versions in zip(vf_trace.branches, _paths(vf_trace), versions)
                    ] if has_tokens else []
        rewards = {name: reward.score for name, reward in vf_trace.rewards.items() if reward is not None}
        rewards.pop(saved.get("reward_entry"), None)
        return Trace(
            id=trace_id if trace_id is not None else vf_trace.id, env=env, example_id=example_id, group_id=group_id,
            branches=branches, messages=messages, agent=vf_trace.agent.name, trainable=vf_trace.agent.trainable,
            reward=vf_trace.reward, rewards=rewards,
            metrics={name: value for name, value in vf_trace.metrics.items() if value is not None},
            info=_jsonable(info), error=None if vf_trace.ok else saved.get("error", _error(vf_trace)),
            policy_step=policy_step if policy_step is not None else saved.get("policy_step", 0),
        )
    except TraceError as exc:
        raise ConversionError(f"trace {vf_trace.id}: {exc}") from None


def _messages(vf_trace: vf.Trace) -> tuple[list[int], list[Message]]:
    """Per node, the index of its message in the trace-rl messages: one message per (depth, message)."""
    depth: list[int] = []
    index_of: dict[tuple[int, str], int] = {}
    messages: list[Message] = []
    message_of: list[int] = []
    for i, node in enumerate(vf_trace.nodes):
        if node.parent is not None and not 0 <= node.parent < i:
            raise ConversionError(f"trace {vf_trace.id}: node {i}'s parent {node.parent} is not an earlier node")
        depth.append(0 if node.parent is None else depth[node.parent] + 1)
        key = (depth[-1], node.message.model_dump_json())
        if key not in index_of:
            index_of[key] = len(messages)
            messages.append(_message(node.message))
        message_of.append(index_of[key])
    return message_of, messages


def _paths(vf_trace: vf.Trace) -> list[list[int]]:
    """Each branch's node ids, root to leaf, in the order of `vf_trace.branches` (one per leaf, by node id)."""
    from verifiers.v1.graph import leaves

    paths = []
    for leaf in leaves(vf_trace):
        path: list[int] = []
        node: int | None = leaf
        while node is not None:
            path.append(node)
            node = vf_trace.nodes[node].parent
        paths.append(path[::-1])
    return paths


def _message(message: Any) -> Message:
    from verifiers.v1.types import content_text

    fields: dict[str, Any] = {"role": message.role, "content": content_text(message.content) or ""}
    if message.role == "tool":
        fields.update(name=message.name, tool_call_id=message.tool_call_id or None)
    if message.role == "assistant" and message.tool_calls:
        fields["tool_calls"] = [ToolCall(id=call.id, name=call.name, arguments=call_arguments(call.arguments))
                                for call in message.tool_calls]
    return Message(**fields)


def call_arguments(raw: str) -> dict[str, Any]:
    """A tool call's arguments as trace-rl keeps them (a JSON object); other input under `input`."""
    try:
        value = json.loads(raw)
    except ValueError:
        return {"input": raw}
    return value if isinstance(value, dict) else {"input": raw}


def _branch(vf_trace: vf.Trace, branch: vf.Branch, node_ids: list[int], message_of: list[int],
            policy_versions: list[int] | None) -> Branch:
    parts: dict[str, list[np.ndarray]] = {name: [] for name in ("token_ids", "sampled", "logprobs", "message_index",
                                                                 "is_content")}
    for node_id in node_ids:
        node = vf_trace.nodes[node_id]
        n = len(node.token_ids)
        where = f"trace {vf_trace.id} node {node_id}"
        if len(node.mask) != n:
            raise ConversionError(f"{where}: {n} token ids but a mask of {len(node.mask)}")
        sampled = np.asarray(node.mask, np.bool_)
        if len(node.logprobs) != int(sampled.sum()):
            raise ConversionError(f"{where}: {len(node.logprobs)} logprobs for {int(sampled.sum())} sampled tokens")
        if node.is_content and len(node.is_content) != n:
            raise ConversionError(f"{where}: {n} token ids but is_content of {len(node.is_content)}")
        logprobs = np.zeros(n, np.float32)
        logprobs[sampled] = node.logprobs
        message_index = np.full(n, message_of[node_id], np.int32)
        if sampled.any():
            message_index[: int(np.argmax(sampled))] = -1  # the generation prompt
        parts["token_ids"].append(np.asarray(node.token_ids, np.int32))
        parts["sampled"].append(sampled)
        parts["logprobs"].append(logprobs)
        parts["message_index"].append(message_index)
        parts["is_content"].append(np.asarray(node.is_content, np.bool_) if node.is_content else sampled.copy())
    arrays = {name: np.concatenate(chunks) if chunks else np.empty(0) for name, chunks in parts.items()}
    return Branch(index=branch.index, temperature=_temperature(vf_trace, branch), trainable=branch.trainable,
                  policy_versions=policy_versions, **arrays)


def _temperature(vf_trace: vf.Trace, branch: vf.Branch) -> float:
    found = {call.sampling.temperature for call in branch.calls
             if call.sampling is not None and call.sampling.temperature is not None}
    if len(found) > 1:
        raise ConversionError(f"trace {vf_trace.id} branch {branch.index}: sampled at temperatures "
                              f"{sorted(found)}; a trace-rl branch has one temperature")
    if found:
        return found.pop()
    sampling = vf_trace.agent.config.sampling
    return sampling.temperature if sampling is not None and sampling.temperature is not None else 1.0


def _error(vf_trace: vf.Trace) -> str:
    if vf_trace.errors:
        last = vf_trace.errors[-1]
        return f"{last.type}: {last.message}"
    return f"the verifiers episode did not end ok (stop condition {vf_trace.stop_condition!r})"


def _jsonable(value: Any) -> Any:
    from pydantic_core import to_jsonable_python

    return to_jsonable_python(value, fallback=str)


# -- trace-rl -> verifiers ------------------------------------------------------------------------------------


def vf_from_trace(trace: Trace, *, model: str | None = None, step: int | None = None) -> vf.WireTrace:
    """The verifiers v1 trace of `trace` (a `vf.WireTrace`: `.to_record()` is its JSON record), with the same
    branches, tokens, sampled mask, logprobs and is_content (see the module's table). `model` is recorded as the
    agent's model, `step` (the step that trained on it) under `info["trace_rl"]`. ConversionError for a branch
    verifiers cannot hold: a message whose tokens are not in one piece, or a branch that is a prefix of another."""
    from verifiers.v1 import AgentInfo, Error, MessageNode, ModelCall, ParentLink, PolicySpan, Reward, SamplingConfig
    from verifiers.v1 import Timing
    from verifiers.v1 import TraceTask, WireTaskData, WireTrace
    from verifiers.v1.configs.agent import WireAgentConfig

    vf_messages = [_vf_message(trace, i, message) for i, message in enumerate(trace.messages)]
    nodes: list[MessageNode] = []
    node_of: dict[tuple, int] = {}
    temperature_of: dict[int, float] = {}

    def node(parent: int | None, message: int, tokens: dict[str, np.ndarray]) -> int:
        key = (parent, message, *(tokens[name].tobytes() for name in sorted(tokens)))
        if key not in node_of:
            sampled = tokens["sampled"]
            nodes.append(MessageNode(
                parent=parent, message=vf_messages[message], sampled=bool(sampled.any()), timestamp=0.0,
                token_ids=tokens["token_ids"].tolist(), mask=sampled.tolist(), is_content=tokens["is_content"].tolist(),
                logprobs=tokens["logprobs"][sampled].astype(np.float64).tolist()))
            node_of[key] = len(nodes) - 1
        return node_of[key]

    leaves = []
    for branch in trace.branches:
        parent = None
        for message, span in _spans(trace, branch):
            tokens = {name: getattr(branch, name)[span] for name in ("token_ids", "sampled", "logprobs", "is_content")}
            parent = node(parent, message, tokens)
            if tokens["sampled"].any():
                if temperature_of.setdefault(parent, branch.temperature) != branch.temperature:
                    raise ConversionError(f"trace {trace.id}: branches {branch.index} and another share a sampled "
                                          "turn at different temperatures")
        if parent is None:
            raise ConversionError(f"trace {trace.id} branch {branch.index}: no tokens; verifiers records a branch "
                                  "by its tokens")
        leaves.append(parent)
    covered = max((int(b.message_index.max(initial=-1)) for b in trace.branches), default=-1)
    if covered + 1 < len(trace.messages):  # messages after every branch's tokens: token-less nodes after the last
        empty = {name: np.empty(0, dtype) for name, dtype in (("token_ids", np.int32), ("sampled", np.bool_),
                                                              ("logprobs", np.float32), ("is_content", np.bool_))}
        parent = leaves[-1] if leaves else None
        for message in range(covered + 1, len(trace.messages)):
            parent = node(parent, message, empty)
        if leaves:
            leaves[-1] = parent
    parents = {n.parent for n in nodes}
    for branch, leaf in zip(trace.branches, leaves):
        if leaf in parents or leaves.count(leaf) > 1:
            raise ConversionError(f"trace {trace.id} branch {branch.index}: its tokens are a prefix of another "
                                  "branch's; a verifiers branch ends at a leaf of the message graph")
        if not branch.trainable:
            link = nodes[leaf].parent if nodes[leaf].parent is not None else leaf
            nodes[leaf].semantic_parents.append(ParentLink(node=link, type="compaction_attempt"))

    saved: dict[str, Any] = {"env": trace.env, "example_id": trace.example_id, "group_id": trace.group_id,
                             "policy_step": trace.policy_step}
    if step is not None:
        saved["step"] = step
    if trace.branches:
        versions = [branch.versions_or(trace.policy_step) for branch in trace.branches]
        sampled = np.concatenate([v[b.sampled] for v, b in zip(versions, trace.branches)])
        if sampled.size:
            saved["policy"] = PolicySpan(start=int(sampled.min()), end=int(sampled.max())).model_dump()
        if all(branch.policy_versions is not None for branch in trace.branches):
            saved["policy_versions"] = [v.tolist() for v in versions]
    rewards = {name: Reward(score=value, weight=1.0) for name, value in trace.rewards.items()}
    if not trace.rewards or sum(trace.rewards.values()) != trace.reward:  # verifiers' reward is the weighted sum
        saved["reward_entry"] = "reward" if "reward" not in trace.rewards else "reward_total"
        rewards = {name: Reward(score=value, weight=0.0) for name, value in trace.rewards.items()}
        rewards[saved["reward_entry"]] = Reward(score=trace.reward, weight=1.0)
    errors = []
    if trace.error is not None:
        saved["error"] = trace.error
        match = ERROR_TYPE.match(trace.error)
        errors = [Error(type=match[1], message=match[2]) if match else Error(type="Error", message=trace.error)]
    example = int(trace.example_id) if trace.example_id.isdecimal() else None
    return WireTrace(
        id=trace.id,
        task=TraceTask(type=trace.env, data=WireTaskData(idx=example, id=trace.example_id), key=trace.example_id),
        agent=AgentInfo(config=WireAgentConfig(model=model), name=trace.agent, trainable=trace.trainable),
        nodes=nodes,
        calls=[ModelCall(node=i, sampling=SamplingConfig(temperature=t)) for i, t in sorted(temperature_of.items())],
        rewards=rewards, metrics=dict(trace.metrics), info={**trace.info, TRACE_RL_INFO: saved},
        is_completed=True, ok=trace.error is None, stop_condition="error" if errors else None, errors=errors,
        timing=Timing(start=0.0),
    )


def record_from_trace(trace: Trace, *, model: str | None = None, step: int | None = None) -> dict[str, Any]:
    """`vf_from_trace(...).to_record()` with every digit of the logprobs (what `vf.WireTrace` reads back)."""
    return vf_from_trace(trace, model=model, step=step).to_record(float_decimals=None)


def _spans(trace: Trace, branch: Branch) -> list[tuple[int, slice]]:
    """The branch as (message, token span) in conversation order, one per message 0 .. its last (a message it
    has no tokens of: an empty span). Tokens of no message (-1) join the next message, or the last at the end."""
    owner = branch.message_index
    n = len(owner)
    owned = np.flatnonzero(owner >= 0)
    if n and not owned.size:
        raise ConversionError(f"trace {trace.id} branch {branch.index}: no token belongs to a message; verifiers "
                              "records every token in a message's node")
    if not n:
        return []
    next_owned = np.minimum.accumulate(np.where(owner >= 0, np.arange(n), n)[::-1])[::-1]
    filled = np.where(next_owned < n, owner[np.minimum(next_owned, n - 1)], owner[owned[-1]])
    starts = np.flatnonzero(np.diff(filled, prepend=filled[0] - 1))
    runs = [(int(filled[s]), slice(int(s), int(e))) for s, e in zip(starts, [*starts[1:], n])]
    order = [message for message, _ in runs]
    if order != sorted(set(order)):
        raise ConversionError(f"trace {trace.id} branch {branch.index}: its messages' tokens are not in one piece "
                              f"each, in conversation order (messages in token order: {order}); a verifiers node "
                              "holds one message's tokens")
    by_message = dict(runs)
    return [(m, by_message.get(m, slice(0, 0))) for m in range(order[-1] + 1)]


def _vf_message(trace: Trace, index: int, message: Message) -> Any:
    from verifiers.v1 import AssistantMessage, SystemMessage, ToolMessage, UserMessage
    from verifiers.v1 import ToolCall as VfToolCall

    if message.role == "system":
        return SystemMessage(content=message.content)
    if message.role == "user":
        return UserMessage(content=message.content)
    if message.role == "assistant":
        calls = [VfToolCall(id=c.id, name=c.name, arguments=json.dumps(c.arguments)) for c in message.tool_calls or []]
        return AssistantMessage(content=message.content, tool_calls=calls or None)
    if message.role == "tool":
        return ToolMessage(content=message.content, tool_call_id=message.tool_call_id or "", name=message.name)
    raise ConversionError(f"trace {trace.id} message {index}: role {message.role!r}; verifiers messages are system, "
                          "user, assistant or tool")
