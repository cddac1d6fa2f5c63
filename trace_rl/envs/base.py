"""The environment API: examples, the sampler a rollout uses, the base class, its args and its errors.

An environment yields examples deterministically from a seed (no downloads) and runs one
rollout of one example with a `Sampler`, returning one scored `Trace` per agent (`reward`,
named `rewards`, `metrics`, `info` such as the `answer`). The rollout loop fills in trace and
group ids and the policy version. Environments are registered by id (`@register_env`,
trace_rl.envs.registry) or loaded from an import path `package.module:ClassName` (trace_rl.envs.lookup).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from trace_rl.config import SamplingConfig
from trace_rl.data.trace import Message, Trace
from trace_rl.errors import RetryableError
from trace_rl.imports import ImportPathError, import_path
from trace_rl.models.render import Conversation, Renderer
from trace_rl.models.runtime import Generation, ModelRuntime
from trace_rl.options import NoOptions, option_problems


def derive_seed(*parts: int | str) -> int:
    """A stable 31-bit seed from any parts (the same parts give the same seed in every process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def epoch_stream(step: int, count: int, size: int, order: Callable[[int], list[int]]) -> list[tuple[int, int]]:
    """(epoch, item) of positions (step - 1) * count ... step * count - 1 of a stream that walks `size` items epoch
    after epoch, each epoch in the order `order(epoch)` gives (a permutation of range(size))."""
    orders: dict[int, list[int]] = {}
    stream = []
    for position in range((step - 1) * count, step * count):
        epoch, offset = divmod(position, size)
        if epoch not in orders:
            orders[epoch] = order(epoch)
        stream.append((epoch, orders[epoch][offset]))
    return stream


@dataclass(frozen=True)
class Example:
    id: str
    data: dict[str, Any] = field(default_factory=dict)


class EnvError(ValueError):
    """A bad environment id or args, or a rollout that cannot go on (not retried)."""


class Sampler:
    """What a rollout samples with: the actor runtime, the env's sampling settings and the rollout's seed.

    Each conversation (one per agent) and each of its turns gets its own seed derived from `seed`, so a
    rollout samples the same tokens whenever it runs with the same seed.
    """

    def __init__(self, runtime: ModelRuntime, sampling: SamplingConfig, seed: int, timeout_s: float | None = None):
        self.runtime = runtime
        self.sampling = sampling
        self.seed = seed
        self.timeout_s = timeout_s

    def conversation(
        self, messages: Sequence[Message] = (), *, tools: list[dict[str, Any]] | None = None, agent: int = 0
    ) -> Conversation:
        seed = derive_seed(self.seed, agent)

        async def generate(prompt_ids: list[int], turn: int) -> Generation:
            return await self.generate(prompt_ids, seed=derive_seed(seed, turn))

        renderer = Renderer(self.runtime.tokenizer, tools, end_of_turn=(self.runtime.config.stop_tokens or [None])[0])
        return Conversation(renderer, generate, temperature=self.sampling.temperature, messages=messages)

    def begin_rollout(self) -> None:
        """The rollout loop calls it before each attempt of the rollout (a retry starts it over). This sampler keeps
        nothing between attempts; one that replays a rollout's recorded calls starts them over."""

    async def generate(self, prompt_ids: list[int], *, seed: int, max_tokens: int | None = None) -> Generation:
        """One turn of at most `max_tokens` (default: the env's `max_completion_tokens`) that fit `max_model_len`."""
        room = self.runtime.config.max_model_len - len(prompt_ids)
        if room <= 0:
            raise EnvError(
                f"prompt of {len(prompt_ids)} tokens leaves no room under max_model_len "
                f"{self.runtime.config.max_model_len}; raise inference.max_model_len or shorten the episode"
            )
        request = self.runtime.generate(
            prompt_ids, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
            max_tokens=min(self.sampling.max_completion_tokens if max_tokens is None else max_tokens, room), seed=seed,
            stop=self.sampling.stop,
        )
        try:
            return await asyncio.wait_for(request, self.timeout_s)
        except TimeoutError as exc:
            raise RetryableError(f"sampler timed out after {self.timeout_s}s") from exc


class Environment:
    """Base class. Subclasses are registered under their id (`@register_env("id")`, which sets `id`), optionally
    set `Options` (a pydantic model of `[env].args`, held validated as `self.args`), and implement `make_example`
    (or `examples`) and `rollout`."""

    id: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoOptions
    # a rollout driven again with the completions it sampled rebuilds its state between turns and does nothing else
    # (no sandbox, no tool with side effects): how `[async] partial_rollout_tokens` continues a rollout
    # (trace_rl.pipeline.partial); an env that cannot be driven so sets it False and partial rollouts refuse it
    drivable_again: ClassVar[bool] = True

    def __init__(self, args: Mapping[str, Any] | None = None):
        self.args = validate_args(type(self), dict(args or {}))

    def make_example(self, rng: random.Random) -> dict[str, Any]:
        raise NotImplementedError

    def examples(self, seed: int, count: int) -> list[Example]:
        """`count` examples, the same for the same seed."""
        return [
            Example(id=f"{seed:x}-{i}", data=self.make_example(random.Random(derive_seed(seed, i))))
            for i in range(count)
        ]

    def examples_for_step(self, run_seed: int, step: int, env_index: int, count: int) -> list[Example]:
        """The `count` examples of one step (from 1) of the env at `env_index`: by default `examples` seeded by
        (run seed, step, env index); an env with a fixed data set overrides it to walk its rows epoch by epoch."""
        return self.examples(derive_seed(run_seed, step, env_index), count)

    def refill_examples(self, run_seed: int, step: int, env_index: int, round_: int, count: int) -> list[Example]:
        """`count` fresh examples for refill round `round_` (from 1) of a step (`[[env]] refill_rounds`): by default
        `examples` seeded by (run seed, step, env index, "refill", round), so a resumed step draws the same ones."""
        return self.examples(derive_seed(run_seed, step, env_index, "refill", round_), count)

    @classmethod
    def check_config(cls, options: BaseModel) -> list[str]:
        """Problems with this env's validated `[env].args` beyond their schema (e.g. a data set's files that do not
        read), checked at load time. Default: none."""
        return []

    @classmethod
    def drive_again_problem(cls, options: BaseModel) -> str | None:
        """Why this env's rollouts with these validated `[env].args` cannot be driven again (`drivable_again`), or
        None."""
        return None if cls.drivable_again else f"{cls.__name__} sets drivable_again = False"

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        raise NotImplementedError

    def trace(
        self, example: Example, conversation: Conversation, *, agent: str = "policy-agent", trainable: bool = True,
        reward: float = 0.0, rewards: Mapping[str, float] | None = None, metrics: Mapping[str, float] | None = None,
        info: Mapping[str, Any] | None = None,
    ) -> Trace:
        """A scored trace of one agent's conversation (ids are filled in by the rollout loop)."""
        return Trace(
            id="", env=self.id, example_id=example.id, group_id="", agent=agent, trainable=trainable,
            branches=conversation.branches, messages=conversation.messages, reward=reward,
            rewards=dict(rewards or {}), metrics={"turns": conversation.turns, **(metrics or {})},
            info=dict(info or {}),
        )


def validate_args(cls: type[Environment], args: dict[str, Any]) -> BaseModel:
    try:
        return cls.Options(**args)
    except ValidationError as exc:
        raise EnvError(f"env {cls.id!r}: " + "; ".join(option_problems(exc, cls.Options, "args."))) from None


def import_named(path: str, what: str) -> Any:
    """The object a `package.module:name` path names; an EnvError naming `what` when it cannot be imported."""
    try:
        return import_path(path, what)
    except ImportPathError as exc:
        raise EnvError(str(exc)) from None
