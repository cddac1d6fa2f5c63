"""ECHO: cross-entropy on the environment's observations (loss `ce`).

The actor did not sample observation tokens (tool results, user feedback, ...), so
no RL signal reaches them; ECHO supervises them instead, teaching the policy to
predict what its environment answers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trace_rl.algorithms.base import Algorithm, AlgorithmError, register
from trace_rl.algorithms.signal import ok_traces
from trace_rl.trace import Branch, Message, Trace

ROLES = ("system", "user", "assistant", "tool")


class RoleOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(1.0, ge=0, allow_inf_nan=False, description="cross-entropy weight of this role's tokens")


class ToolOptions(RoleOptions):
    tool_names: set[str] | None = Field(None, min_length=1, description="only these tools' results; omitted: all")


class FilterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    import_path: str = Field(..., description="'package.module:function' called as fn(trace, **kwargs)")
    kwargs: dict[str, Any] = {}


class EchoOptions(BaseModel):
    """Each role is off (omitted or `false`), on with alpha 1.0 (`{}` or `true`), or `{alpha = ...}`."""

    model_config = ConfigDict(extra="forbid")
    system: RoleOptions | None = None
    user: RoleOptions | None = None
    assistant: RoleOptions | None = None
    tool: ToolOptions | None = ToolOptions(alpha=0.1)
    include_prompt: bool = Field(False, description="also supervise the initial prompt's messages")
    filter: FilterOptions | None = None

    @field_validator(*ROLES, mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        if value is False:
            return None
        return {} if value is True else value

    @model_validator(mode="after")
    def _some_role(self) -> EchoOptions:
        if all(getattr(self, role) is None for role in ROLES):
            raise ValueError("echo enables no role; enable at least one of system, user, assistant, tool")
        return self


def resolve_filter(import_path: str) -> Callable[..., Any]:
    module_name, _, attr = import_path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr) if attr else None
    except (ImportError, AttributeError) as exc:
        raise AlgorithmError(f"echo filter {import_path!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise AlgorithmError(f"echo filter {import_path!r} must name a callable as 'package.module:function'")
    return fn


def tool_name(message: Message, call_names: dict[str, str]) -> str | None:
    """The tool a result came from: its `name`, else the name of the call its `tool_call_id` answers."""
    return message.name or call_names.get(message.tool_call_id or "")


def observation_weights(branch: Branch, selected: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ECHO: L = -sum_{t in O} alpha_role(t) * log pi_theta(o_t | o_<t).

    O: content tokens of the selected messages (observations of enabled roles; `selected`
    and `alpha` have one entry per message plus a last one for message_index -1), never
    token 0. Returns (values = alpha on O and 0 elsewhere, mask = O).
    """
    slots = branch.message_index.astype(np.intp)  # numpy indexes fastest with intp
    mask = selected[slots] & branch.is_content
    if len(mask):
        mask[0] = False
    return alpha[slots] * mask, mask


@register("echo")
class Echo(Algorithm):
    """Per-role cross-entropy on observation tokens; by default tool results with alpha 0.1.

    A message is an observation if no branch of the trace sampled it and it comes after
    the first sampled message (`include_prompt` adds the ones before). Each message is
    supervised once per trace, in the first branch that holds it; branches without
    observations stay unannotated. A role with alpha 0 still marks its tokens (mask true,
    value 0). `filter` can only narrow the selection.
    """

    loss = "ce"
    Options = EchoOptions

    def __init__(self, config):
        super().__init__(config)
        options: EchoOptions = self.options
        self.role_alpha = {role: getattr(options, role).alpha for role in ROLES if getattr(options, role) is not None}
        self.filter = resolve_filter(options.filter.import_path) if options.filter else None

    @classmethod
    def check_config(cls, options: EchoOptions, run_config: Any) -> list[str]:
        if options.filter is None:
            return []
        try:
            resolve_filter(options.filter.import_path)
        except AlgorithmError as exc:
            return [str(exc)]
        return []

    def observations(self, trace: Trace) -> tuple[np.ndarray, np.ndarray]:
        """Per message (plus a slot for message_index -1): is it supervised, and with which alpha."""
        count = len(trace.messages)
        flags = np.zeros(count + 1, np.bool_)
        for branch in trace.branches:
            flags[branch.message_index[branch.sampled].astype(np.intp)] = True
        sampled = flags[:count].tolist()
        first_sampled = 0 if self.options.include_prompt else sampled.index(True) if True in sampled else count
        tool_names = self.options.tool.tool_names if self.options.tool is not None else None
        call_names = {c.id: c.name for m in trace.messages for c in m.tool_calls or ()} if tool_names else {}
        selected, alpha = [False] * (count + 1), [0.0] * (count + 1)
        for index, message in enumerate(trace.messages):
            if message.role not in self.role_alpha or sampled[index] or index < first_sampled:
                continue
            if message.role == "tool" and tool_names and tool_name(message, call_names) not in tool_names:
                continue
            selected[index], alpha[index] = True, self.role_alpha[message.role]
        return np.array(selected), np.array(alpha, np.float32)

    def narrow(self, trace: Trace, masks: list[np.ndarray]) -> list[np.ndarray]:
        path = self.options.filter.import_path
        result = self.filter(trace, **self.options.filter.kwargs)
        if not isinstance(result, list | tuple) or len(result) != len(trace.branches):
            got = f"{len(result)} items" if isinstance(result, list | tuple) else type(result).__name__
            raise AlgorithmError(
                f"echo filter {path!r} must return a list of one bool mask per branch "
                f"({len(trace.branches)} for trace {trace.id!r}), got {got}"
            )
        narrowed = []
        for branch, mask, keep in zip(trace.branches, masks, result):
            keep = np.asarray(keep)
            if keep.dtype != np.bool_ or keep.shape != mask.shape:
                raise AlgorithmError(
                    f"echo filter {path!r} returned for trace {trace.id!r} branch {branch.index} a "
                    f"{keep.dtype} array of shape {keep.shape}; expected bool of shape {mask.shape}"
                )
            narrowed.append(mask & keep)
        return narrowed

    async def advantage(self, traces: list[Trace]) -> None:
        for trace in ok_traces(traces):
            if not trace.branches:
                continue
            selected, alpha = self.observations(trace)
            values, masks = [], []
            for branch in trace.branches:
                branch_values, mask = observation_weights(branch, selected, alpha)
                if len(trace.branches) > 1:
                    selected[branch.message_index[mask]] = False
                values.append(branch_values)
                masks.append(mask)
            if self.filter is not None:
                masks = self.narrow(trace, masks)
                values = [v * mask for v, mask in zip(values, masks)]
            for branch, branch_values, mask in zip(trace.branches, values, masks):
                if np.count_nonzero(mask):
                    branch.advantages, branch.mask = branch_values, mask
