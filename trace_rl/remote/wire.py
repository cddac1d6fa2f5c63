"""The env server's wire format: JSON bodies described by pydantic models, versioned, data only.

A request carries one group's traces (`WireTrace`: the JSON shape of `Trace.to_dict()`), the
algorithm configs to run in order, and the model runtime configs the algorithms may build
runtimes from. The reply holds one result per requested algorithm, in the same order, each
listing the channels that algorithm set (branches it left alone are absent). Floats travel as JSON numbers,
which hold every float32 exactly; NaN and infinities travel as the constants `NaN` and
`Infinity` so the receiving side can name them rather than lose them. See docs/remote.md.

The trace models are written out here, not derived from `Trace`: they are the protocol's word,
which a rename inside trace-rl must not change. Within a protocol version, a renamed trace field
keeps its old name as an alias.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.data.channel import Channel
from trace_rl.data.trace import Message, Trace
from trace_rl.models.runtime import RuntimeConfig

PROTOCOL_VERSION = 1

Int32 = Annotated[int, Field(ge=np.iinfo(np.int32).min, le=np.iinfo(np.int32).max)]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class Health(Wire):
    version: int = PROTOCOL_VERSION
    envs: list[str]
    algorithms: list[str]


class WireBranch(Wire):
    """One branch: its per-token arrays as lists of one length (see trace_rl.data.trace), annotations null if unset.
    `trainable` is sent only when false and `policy_versions` only when recorded, so such a branch is what every
    protocol-1 server reads."""

    index: int = 0
    temperature: float = 1.0
    trainable: bool = True
    token_ids: list[Int32]
    sampled: list[bool]
    logprobs: list[float]
    message_index: list[Int32]
    is_content: list[bool]
    advantages: list[float] | None = None
    mask: list[bool] | None = None
    policy_versions: list[Int32] | None = None

    @model_serializer(mode="wrap")
    def _trainable_only_when_false(self, handler):
        data = handler(self)
        if self.trainable:
            data.pop("trainable", None)
        if self.policy_versions is None:
            data.pop("policy_versions", None)
        return data


class WireTrace(Wire):
    """One trace, exactly as `Trace.to_dict()` writes it; `policy_version` (its name before the rename) is
    read as `policy_step`."""

    id: str
    env: str
    example_id: str
    group_id: str
    agent: str = "policy-agent"
    trainable: bool = True
    reward: float = 0.0
    rewards: dict[str, float] = {}
    metrics: dict[str, float] = {}
    info: dict[str, Any] = {}
    messages: list[Message] = []
    error: str | None = None
    policy_step: int = 0
    branches: list[WireBranch] = []

    @model_validator(mode="before")
    @classmethod
    def read_policy_version_as_policy_step(cls, data: Any) -> Any:
        if isinstance(data, dict) and "policy_version" in data:
            if "policy_step" in data:
                raise ValueError("both 'policy_version' and 'policy_step' given: policy_version is the old name of "
                                 f"policy_step in protocol version {PROTOCOL_VERSION}; send one of them")
            data = {("policy_step" if key == "policy_version" else key): value for key, value in data.items()}
        return data

    @field_serializer("messages")
    def messages_without_nulls(self, messages: list[Message]) -> list[dict[str, Any]]:
        return [message.model_dump(exclude_none=True) for message in messages]

    @classmethod
    def of(cls, trace: Trace) -> WireTrace:
        return cls.model_validate(trace.to_dict())

    def to_trace(self) -> Trace:
        return Trace.from_dict(self.model_dump())


class RunRequest(Wire):
    version: int = PROTOCOL_VERSION
    algorithms: list[AlgorithmConfig]
    models: dict[str, RuntimeConfig] = {}
    traces: list[WireTrace]
    # the traces are every group of the step, not one group (sent only when true: then a server older than
    # this field refuses the request instead of reading it as one group's)
    whole_step: bool = False

    @model_serializer(mode="wrap")
    def _whole_step_only_when_true(self, handler):
        data = handler(self)
        if not self.whole_step:
            data.pop("whole_step", None)  # the body of one group stays what every protocol-1 server reads
        return data

    @model_validator(mode="before")
    @classmethod
    def refuse_other_versions(cls, data: Any) -> Any:
        """Checked first: a request of another version is not read as one of this version."""
        version = data.get("version", PROTOCOL_VERSION) if isinstance(data, dict) else PROTOCOL_VERSION
        if version != PROTOCOL_VERSION:
            raise PydanticCustomError(
                "protocol_version", "protocol version {version} is not supported; this server speaks protocol version "
                "{spoken}", {"version": version, "spoken": PROTOCOL_VERSION})
        return data


class WireChannel(Wire):
    trace_id: str
    branch_index: int
    loss: str
    values: list[float]
    mask: list[bool]

    @classmethod
    def of(cls, channel: Channel) -> WireChannel:
        return cls(trace_id=channel.trace_id, branch_index=channel.branch_index, loss=channel.loss,
                   values=channel.values.tolist(), mask=channel.mask.tolist())


class AlgorithmResult(Wire):
    algorithm_id: str
    channels: list[WireChannel]


class RunReply(Wire):
    version: int = PROTOCOL_VERSION
    results: list[AlgorithmResult]


class ErrorReply(Wire):
    """The body of every error status the server sends."""

    error: str
