"""The env server's wire format: JSON bodies described by pydantic models, versioned, data only.

A request carries one group's traces (`Trace.to_dict()`), the algorithm configs to run in
order, and the model runtime configs the algorithms may build runtimes from. The reply
holds one result per requested algorithm, in the same order, each listing the channels
that algorithm set (branches it left alone are absent). Floats travel as JSON numbers,
which hold every float32 exactly; NaN and infinities travel as the constants `NaN` and
`Infinity` so the receiving side can name them rather than lose them. See docs/remote.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from trace_rl.algorithms.base import AlgorithmConfig, Channel
from trace_rl.models import RuntimeConfig

PROTOCOL_VERSION = 1


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class Health(Wire):
    version: int = PROTOCOL_VERSION
    envs: list[str]
    algorithms: list[str]


class RunRequest(Wire):
    version: int = PROTOCOL_VERSION
    algorithms: list[AlgorithmConfig]
    models: dict[str, RuntimeConfig] = {}
    traces: list[dict[str, Any]]


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
