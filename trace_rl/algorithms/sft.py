"""Supervised fine-tuning on the actor's tokens (loss `ce`): distillation by imitation."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trace_rl.algorithms.base import Algorithm
from trace_rl.algorithms.registry import register_algorithm
from trace_rl.algorithms.signal import ok_traces, set_on_sampled
from trace_rl.data.trace import Trace
from trace_rl.names import POLICY


class SFTOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight: float = Field(1.0, gt=0, allow_inf_nan=False, description="cross-entropy weight per sampled token")


@register_algorithm("sft")
class SFT(Algorithm):
    """Cross-entropy on the sampled tokens: L = -sum_t w * log pi_theta(x_t | x_<t), w = `weight` (1.0).

    Meant for `actor = "reference"`: the reference samples and the policy learns its tokens.
    """

    loss = "ce"
    Options = SFTOptions

    @classmethod
    def check_config(cls, options: SFTOptions, run_config: Any) -> list[str]:
        if run_config.actor == POLICY:
            return [
                "sft trains the policy on the actor's own tokens, which with actor = 'policy' teaches it nothing; "
                "set actor to another model, e.g. actor = 'reference' with [models.reference] tokens = true"
            ]
        return []

    async def advantage(self, traces: list[Trace]) -> None:
        for trace in ok_traces(traces):
            for branch in trace.branches:
                set_on_sampled(branch, self.options.weight)
