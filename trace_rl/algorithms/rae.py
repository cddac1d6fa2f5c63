"""Role-conditioned advantage estimation (SPIRAL, arXiv 2506.24119): a running baseline per role."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trace_rl.algorithms.base import Algorithm, AlgorithmError
from trace_rl.algorithms.registry import register_algorithm
from trace_rl.algorithms.signal import ok_traces, set_on_sampled
from trace_rl.data.trace import Trace


class RAEOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    decay: float = Field(0.95, ge=0, lt=1, description="weight of the old baseline in each update")
    key: Literal["agent", "example"] = Field(
        "agent", description="one baseline per agent, or per (env, example_id, agent) with 'example'"
    )


def role_conditioned(reward: float, baseline: float, decay: float) -> tuple[float, float]:
    """RAE: A = r - b[key], then b[key] <- decay * b[key] + (1 - decay) * r. Returns (A, new b[key])."""
    return reward - baseline, decay * baseline + (1 - decay) * reward


@register_algorithm("rae")
class RAE(Algorithm):
    """A = r - b[key] on the trace's sampled tokens, b an exponential moving average of past rewards.

    Baselines start at 0, are updated trace by trace in group order, and are saved in
    checkpoints (`state_dict`) so a resumed run continues with the same baselines.
    """

    loss = "rl"
    Options = RAEOptions

    def __init__(self, config):
        super().__init__(config)
        self.baselines: dict[str, float] = {}

    def baseline_key(self, trace: Trace) -> str:
        if self.options.key == "agent":
            return trace.agent
        return json.dumps([trace.env, trace.example_id, trace.agent])

    async def advantage(self, traces: list[Trace]) -> None:
        for trace in ok_traces(traces):
            key = self.baseline_key(trace)
            advantage, self.baselines[key] = role_conditioned(
                trace.reward, self.baselines.get(key, 0.0), self.options.decay
            )
            for branch in trace.branches:
                set_on_sampled(branch, advantage)

    def state_dict(self) -> dict[str, Any]:
        return {"key": self.options.key, "baselines": dict(self.baselines)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore checkpointed baselines; an empty state (a run's first step) starts from none."""
        if not state:
            self.baselines = {}
            return
        if set(state) != {"key", "baselines"}:
            raise AlgorithmError(f"rae {self.id!r}: state must have keys 'key' and 'baselines', got {sorted(state)}")
        if state["key"] != self.options.key:
            raise AlgorithmError(
                f"rae {self.id!r}: checkpointed baselines are per {state['key']!r} but key = {self.options.key!r}"
            )
        baselines = {str(k): float(v) for k, v in state["baselines"].items()}
        bad = [k for k, v in baselines.items() if not math.isfinite(v)]
        if bad:
            raise AlgorithmError(f"rae {self.id!r}: baseline {bad[0]!r} is not finite")
        self.baselines = baselines
