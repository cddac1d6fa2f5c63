"""On-policy distillation from a scoring model (loss `rl`): opd (a reference) and opsd (self, with a hint).

Both score each branch's tokens with a token-capable model and push the policy toward
it token by token. The teacher is scored at the branch's own sampling temperature by
default, so both logprobs come from the same processed distribution (`inference_logprobs`
are the actor's logprobs after temperature scaling); set `temperature` to score the
teacher at a fixed temperature instead (e.g. 1.0 for its raw distribution).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from trace_rl.algorithms.base import Algorithm, AlgorithmError
from trace_rl.aio import gather_or_cancel
from trace_rl.algorithms.registry import register_algorithm
from trace_rl.algorithms.signal import ok_traces, set_on_sampled
from trace_rl.data.trace import Branch, Trace
from trace_rl.names import POLICY


class DistillOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field("reference", description="key of the token-capable model that scores the branches")
    max_concurrent: int = Field(32, gt=0, description="scoring calls in flight at once")
    temperature: float | None = Field(
        None, gt=0, description="temperature the teacher is scored at; default: the branch's sampling temperature"
    )


def distillation_advantage(teacher_logprobs: np.ndarray, inference_logprobs: np.ndarray) -> np.ndarray:
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): A_t = log p_teacher(x_t | x_<t)
    - log pi_actor(x_t | x_<t), the negative per-token reverse KL, on the actor's sampled tokens."""
    return teacher_logprobs - inference_logprobs


class TeacherDistillation(Algorithm):
    """Shared machinery: bounded, round-robin scoring of every ok branch by `options.model`."""

    loss = "rl"
    Options = DistillOptions

    def __init__(self, config):
        super().__init__(config)
        self.teacher: Any = None
        self.calls = 0
        self.limit: asyncio.Semaphore | None = None
        self.limit_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def check_config(cls, options: DistillOptions, run_config: Any) -> list[str]:
        key = options.model
        if key == POLICY:
            return []
        if key not in run_config.models:
            known = ", ".join([POLICY, *run_config.models])
            return [f"model {key!r} is not configured (models: {known}); add [models.{key}] with tokens = true"]
        if not run_config.models[key].tokens:
            return [f"models.{key} must set tokens = true: its logprobs of the sampled tokens are the teacher signal"]
        return []

    @classmethod
    def models_used(cls, options: DistillOptions) -> set[str]:
        return {options.model}

    async def setup(self, models: Mapping[str, Any]) -> None:
        if self.options.model not in models:
            raise AlgorithmError(
                f"{self.id!r} scores with model {self.options.model!r}, but only {sorted(models)} are running"
            )
        self.teacher = models[self.options.model]

    def semaphore(self) -> asyncio.Semaphore:
        """The `max_concurrent` bound, shared by all groups running in the current event loop."""
        loop = asyncio.get_running_loop()
        if self.limit_loop is not loop:
            self.limit, self.limit_loop = asyncio.Semaphore(self.options.max_concurrent), loop
        return self.limit

    async def score(self, token_ids: list[int], temperature: float) -> np.ndarray:
        async with self.semaphore():
            endpoint = self.calls % max(1, self.teacher.num_endpoints)
            self.calls += 1
            return np.asarray(
                await self.teacher.score(token_ids, temperature=temperature, endpoint=endpoint), np.float32
            )

    async def teacher_logprobs(self, trace: Trace, branch: Branch, temperature: float) -> np.ndarray:
        return await self.score(branch.token_ids.tolist(), temperature)

    async def distill(self, trace: Trace, branch: Branch) -> None:
        temperature = self.options.temperature or branch.temperature
        teacher = await self.teacher_logprobs(trace, branch, temperature)
        if teacher.shape != branch.logprobs.shape:
            raise AlgorithmError(
                f"{self.id!r}: model {self.options.model!r} returned {teacher.shape[0]} logprobs for trace "
                f"{trace.id!r} branch {branch.index} of {len(branch)} tokens"
            )
        set_on_sampled(branch, distillation_advantage(teacher, branch.logprobs))

    async def advantage(self, traces: list[Trace]) -> None:
        if self.teacher is None:
            raise AlgorithmError(f"{self.id!r}: call `await algorithm.setup(models)` before running it")
        await gather_or_cancel(self.distill(trace, branch) for trace in ok_traces(traces) for branch in trace.branches)


@register_algorithm("opd")
class OPD(TeacherDistillation):
    """On-policy distillation: A_t = ref_logprob_t - inference_logprob_t on sampled tokens.

    The reference (`model`, default "reference") scores the branch's exact tokens.
    """


class OPSDOptions(DistillOptions):
    model: str = Field("policy", description="key of the token-capable teacher model")
    hint: str = Field(
        "A worked solution to the task that follows:\n{demonstration}",
        description="system message prepended for the teacher; {demonstration} is replaced",
    )

    @field_validator("hint")
    @classmethod
    def _has_placeholder(cls, hint: str) -> str:
        if "{demonstration}" not in hint:
            raise ValueError("hint must contain '{demonstration}'")
        return hint


def demonstration(trace: Trace) -> str:
    found = trace.info.get("demonstration") or trace.info.get("answer")
    if found is None or found == "":
        raise AlgorithmError(
            f"opsd: trace {trace.id!r} (env {trace.env!r}, example {trace.example_id!r}) has neither "
            "info['demonstration'] nor info['answer'] to show the teacher; have the env set one, or use opd"
        )
    return str(found)


@register_algorithm("opsd")
class OPSD(TeacherDistillation):
    """On-policy self-distillation: A_t = log p(x_t | hint, x_<t) - inference_logprob_t on sampled tokens.

    The teacher (`model`, default "policy") sees a hint block, a system message rendered
    with the chat template that shows `info["demonstration"]` (else `info["answer"]`),
    before the branch; it scores hint + branch tokens and the branch part is kept.
    """

    Options = OPSDOptions

    def hint_ids(self, trace: Trace) -> list[int]:
        content = self.options.hint.replace("{demonstration}", demonstration(trace))
        tokenizer = self.teacher.tokenizer
        text = tokenizer.apply_chat_template([{"role": "system", "content": content}], tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    async def teacher_logprobs(self, trace: Trace, branch: Branch, temperature: float) -> np.ndarray:
        hint = self.hint_ids(trace)
        scored = await self.score(hint + branch.token_ids.tolist(), temperature)
        return scored[len(hint):]
