"""ECHO: cross-entropy on the environment's observations (loss `ce`).

The actor did not sample observation tokens (tool results, user feedback, ...), so
no RL signal reaches them; ECHO supervises them instead, teaching the policy to
predict what its environment answers.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trace_rl.algorithms.base import Algorithm, AlgorithmError
from trace_rl.algorithms.registry import register_algorithm
from trace_rl.algorithms.signal import ok_traces
from trace_rl.data.trace import Message, Trace
from trace_rl.imports import ImportPathError, import_path

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


def resolve_filter(path: str) -> Callable[..., Any]:
    try:
        fn = import_path(path, "echo filter")
    except ImportPathError as exc:
        raise AlgorithmError(str(exc)) from None
    if not callable(fn):
        raise AlgorithmError(f"echo filter {path!r} must name a callable as 'package.module:function'")
    return fn


def tool_name(message: Message, call_names: dict[str, str]) -> str | None:
    """The tool a result came from: its `name`, else the name of the call its `tool_call_id` answers."""
    return message.name or call_names.get(message.tool_call_id or "")


def observation_weights(
    slots: np.ndarray, is_content: np.ndarray, selected: np.ndarray, alpha: np.ndarray, first_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """ECHO: L = -sum_{t in O} alpha_role(t) * log pi_theta(o_t | o_<t).

    O: content tokens of the selected messages, never a branch's token 0. Works on any number of
    branches at once: `slots` maps each token to its message's entry of `selected`/`alpha`, and
    `first_tokens` are the positions of the branches' token 0. Returns (values = alpha on O and 0
    elsewhere, mask = O).
    """
    mask = selected[slots] & is_content
    mask[first_tokens] = False
    return alpha[slots] * mask, mask


def first_holders(slots: np.ndarray, mask: np.ndarray, branch_of_token: np.ndarray) -> np.ndarray:
    """Keep each message's tokens only in the first branch (by position) that masks any of them."""
    first = np.full(int(slots.max(initial=-1)) + 1, np.iinfo(np.intp).max, np.intp)
    np.minimum.at(first, slots[mask], branch_of_token[mask])
    return mask & (first[slots] == branch_of_token)


@register_algorithm("echo")
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
    per_trace = True

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

    def message_alpha(self, trace: Trace) -> list[float]:
        """Per message: its role's alpha, or NaN when its role (or its tool) is not supervised."""
        tool_names = self.options.tool.tool_names if self.options.tool is not None else None
        call_names = {c.id: c.name for m in trace.messages for c in m.tool_calls or ()} if tool_names else {}
        alphas = [self.role_alpha.get(message.role, np.nan) for message in trace.messages]
        if tool_names:
            for index, message in enumerate(trace.messages):
                if message.role == "tool" and tool_name(message, call_names) not in tool_names:
                    alphas[index] = np.nan
        return alphas

    def observations(self, traces: list[Trace], slot_base: np.ndarray, slots: np.ndarray,
                     sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per message slot of all `traces`: is it supervised, and with which alpha.

        Trace i owns slots slot_base[i] (its tokens with message_index -1) to slot_base[i + 1] - 1 (its
        messages in order). A message is supervised when its role is, no branch sampled it and, unless
        `include_prompt`, it comes after the trace's first sampled message.
        """
        alpha = np.array([value for trace in traces for value in (np.nan, *self.message_alpha(trace))], np.float32)
        was_sampled = np.zeros(len(alpha), np.bool_)
        was_sampled[slots[sampled]] = True
        selected = ~np.isnan(alpha) & ~was_sampled
        if not self.options.include_prompt:
            position = np.arange(len(alpha))
            was_sampled[slot_base[:-1]] = False  # the -1 slot is no message
            first_sampled = np.minimum.reduceat(np.where(was_sampled, position, len(alpha)), slot_base[:-1])
            selected &= position >= np.repeat(first_sampled, np.diff(slot_base))
        return selected, np.nan_to_num(alpha, nan=0.0)

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
        traces = [trace for trace in ok_traces(traces) if trace.branches]
        if not traces:
            return
        branches = [branch for trace in traces for branch in trace.branches]
        slot_base = np.cumsum([0, *(len(trace.messages) + 1 for trace in traces)])
        lengths = np.array([len(branch) for branch in branches])
        branch_base = np.repeat(slot_base[:-1] + 1, [len(trace.branches) for trace in traces])
        slots = np.repeat(branch_base, lengths) + np.concatenate([b.message_index for b in branches])
        sampled = np.concatenate([b.sampled for b in branches])
        selected, alpha = self.observations(traces, slot_base, slots, sampled)
        starts = np.cumsum([0, *lengths])
        values, mask = observation_weights(slots, np.concatenate([b.is_content for b in branches]), selected, alpha,
                                           starts[:-1][lengths > 0])
        if len(branches) > len(traces):
            mask = first_holders(slots, mask, np.repeat(np.arange(len(branches)), lengths))
            values = values * mask
        bounds = list(pairwise(starts.tolist()))
        branch_values, branch_masks = [values[a:b] for a, b in bounds], [mask[a:b] for a, b in bounds]
        if self.filter is not None:
            at = 0
            for trace in traces:
                end = at + len(trace.branches)
                branch_masks[at:end] = self.narrow(trace, branch_masks[at:end])
                branch_values[at:end] = [v * m for v, m in zip(branch_values[at:end], branch_masks[at:end])]
                at = end
            mask = np.concatenate(branch_masks)
        masked_before = np.searchsorted(np.flatnonzero(mask), starts)
        for branch, branch_value, branch_mask, count in zip(branches, branch_values, branch_masks,
                                                              np.diff(masked_before)):
            if count:
                branch.advantages, branch.mask = branch_value, branch_mask
