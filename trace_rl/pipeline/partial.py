"""Partial rollouts (`[async] partial_rollout_tokens = N`): rollouts in flight across steps, cut every N tokens.

The sampler keeps the groups of two steps in flight: step 1 starts the examples of steps 1 and 2, every later step
s those of step s + 1 (`Environment.examples_for_step`, seeded as without the option, group ids
`step<origin>-<env>-<example>`). It advances every unfinished rollout by one segment of at most N sampled tokens
at a time, all of them together, at least once every step and then until each env has `batch_size` groups whose
rollouts have all ended. Each env
trains exactly `batch_size` of its ended groups, oldest first (by origin step, then example); the others stay in
flight. A rollout that has not ended continues at the next step under that step's weights, from its exact token
ids: the prompt plus every token sampled so far, never re-tokenized. Each token records the weights that sampled it
(`Branch.policy_versions`), and its logprob is the one those weights gave it. The weights are those the schedule of
`[async] max_off_policy_steps` gives the step (trace_rl.pipeline.schedule: with k = 0 the step's own, sampled before
it trains), and `[async] max_token_age` bounds how old a trained token may be (trace_rl.pipeline.token_age).

A segment is sampled by driving the env's rollout again with what it sampled so far, the sequence of its
`generate` calls (`Call`): the k-th call of the drive returns the k-th recorded one's completion when that call had
ended (no model call), and the call that had not ended continues with one more segment from its exact ids (the
prompt the env renders now plus the call's tokens so far: its prefill covers them). A segment samples at most N
tokens over the rollout's calls; when they run out before the rollout ends, its `generate` stops the env there
(`SegmentCut`). So an env's state between turns (tool results, a game's moves, other agents' turns) is rebuilt by
driving it again, making no model call but the segment's. Each call records a digest of its prompt: a drive that
renders another prompt for a recorded call (an env that is not a function of its sampled tokens) fails the rollout
with an error naming the call, instead of continuing a different episode. An env that cannot be driven again (a
sandbox, tools with side effects: `Environment.drive_again_problem`), an env server, and the other settings
`check_partial` names are refused in one line.

The rollouts in flight after step s are written with it, atomically, to `steps/<s>/in_flight.json` (`InFlight`),
before its traces; step s + 1 reads them back, so `train --resume` after a crash continues every one of them
exactly where it was and the run ends bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from trace_rl.aio import gather_or_cancel
from trace_rl.config import Config
from trace_rl.data.trace import NOT_SAMPLED, Trace
from trace_rl.envs.base import EnvError, Sampler, derive_seed, validate_args
from trace_rl.envs.lookup import load_env, resolve_env_class
from trace_rl.errors import RefusedError
from trace_rl.models.runtime import Generation, ModelRuntime
from trace_rl.pipeline.rollouts import (
    MAX_LISTED_ERRORS,
    RolloutSummary,
    check_error_fraction,
    env_names,
    label,
    run_rollout,
    summarize,
)
from trace_rl.pipeline.token_age import drop_stale
from trace_rl.storage import RunStorage

IN_FLIGHT = "in_flight.json"
AHEAD = 1  # steps whose examples start before they train: the pool holds about (1 + AHEAD) steps of groups


class SegmentCut(BaseException):
    """Raised inside an env's rollout when its segment ended before the rollout did: the rollout stays in flight.
    A BaseException, so that neither an env's own `except Exception` nor the retry loop takes it for a failure."""


class InFlightError(RefusedError):
    """An in-flight store a resumed step cannot read: the message names the file and the fix."""


class Call(BaseModel):
    """One `generate` call of a rollout: the prompt it was asked with and what it sampled so far."""

    model_config = ConfigDict(extra="forbid")
    prompt_digest: str  # `prompt_digest` of the prompt ids the env rendered for it
    token_ids: list[int] = []  # sampled so far, in order
    logprobs: list[float] = []  # each under the weights that sampled it
    versions: list[int] = []  # the weights step that sampled each token
    finish_reason: str | None = None  # None: the call has not ended (it continues in the next segment)


class Rollout(BaseModel):
    """One rollout of the pool: which it is, its generate calls so far and, once it ended, its traces."""

    model_config = ConfigDict(extra="forbid")
    origin: int  # the step whose examples it belongs to
    env_index: int
    example_index: int
    rollout: int
    calls: list[Call] = []  # in the order the env made them
    traces: list[dict] | None = None  # `Trace.to_dict()` of each trace, once the env returned them; None: in flight
    retries: int = 0

    @property
    def sampled_tokens(self) -> int:
        """Tokens sampled so far, over every call."""
        return sum(len(call.token_ids) for call in self.calls)


class InFlight(BaseModel):
    """`steps/<s>/in_flight.json`: the rollouts in flight after step `step` (ended ones not yet trained included)."""

    model_config = ConfigDict(extra="forbid")
    step: int
    rollouts: list[Rollout]


def check_partial(config: Config) -> list[str]:
    """The problems of `[async] partial_rollout_tokens` with the run's envs (none when the option is unset)."""
    if config.async_.partial_rollout_tokens is None:
        return []
    key = "async.partial_rollout_tokens"
    problems = []
    if config.token_age_bound < 1:
        problems.append(f"{key} continues rollouts under newer weights, but async.max_token_age = 0 would mask every "
                        "token an earlier step sampled: set async.max_token_age >= 1, how many steps older than the "
                        "weights its step trains from a trained token may be, or remove it for the default "
                        "(trace_rl.pipeline.token_age)")
    if config.inference.base_url:
        problems.append(f"inference.base_url: {key} continues rollouts on an in-process sampler only yet (the hf "
                        f"or vllm backend); remove base_url or {key}")
    for i, env in enumerate(config.env):
        if env.verifiers_server is not None:  # trace-rl's env server runs algorithms only: rollouts play here
            problems.append(f"env.{i}.server: {key} does not continue episodes a verifiers env server plays; play "
                            f"the env in-process (remove server) or remove {key}")
            continue
        try:
            cls = resolve_env_class(env.id)
            problem = cls.drive_again_problem(validate_args(cls, dict(env.args)))
        except EnvError:
            continue  # check_envs names it
        if problem:
            problems.append(f"env.{i}: {key} continues a rollout by driving its env again with the tokens it "
                            f"sampled, which env {env.id!r} cannot be ({problem}); remove {key} or train another env")
        if env.drop_uniform_groups:
            problems.append(f"env.{i}.drop_uniform_groups: not supported with {key} yet; remove one of them")
        if config.sampling_for(env).stop:
            problems.append(f"env.{i} sampling.stop: a stop string may span a cut; with {key} end turns with stop "
                            "tokens ([model] stop_tokens) instead")
    return problems


def prompt_digest(prompt_ids: list[int]) -> str:
    """A digest of a call's prompt ids (what `Call` records of its prompt)."""
    return hashlib.blake2b(np.asarray(prompt_ids, np.int64).tobytes(), digest_size=16).hexdigest()


class SegmentSampler(Sampler):
    """The sampler of one rollout's segment. The k-th `generate` of a drive (`begin_rollout` starts one: a retry
    drives the rollout again from its first call) returns the k-th recorded call's completion when that call had
    ended; the call that had not ended, and a new one, sample at most what is left of the segment's `tokens`
    (sampled once per drive, however often a retry asks again) and raise SegmentCut when it ran out first."""

    def __init__(self, runtime: ModelRuntime, config: Config, env_index: int, record: Rollout, seed: int,
                 tokens: int):
        env = config.env[env_index]
        super().__init__(runtime, config.sampling_for(env), seed, timeout_s=config.inference.request_timeout_s)
        self.record = record
        self.left = tokens  # of the segment
        self.next_call = 0

    def begin_rollout(self) -> None:
        self.next_call = 0

    async def generate(self, prompt_ids: list[int], *, seed: int) -> Generation:
        index, self.next_call = self.next_call, self.next_call + 1
        digest = prompt_digest(prompt_ids)
        calls = self.record.calls
        if index < len(calls) and calls[index].prompt_digest != digest:
            raise EnvError(f"generate call {index + 1} of the rollout rendered another prompt than when it was "
                           "sampled: the env is not a function of its example and the tokens it sampled, so partial "
                           "rollouts cannot continue it; make it one (sample its turns one after another), or set "
                           "drivable_again = False on its class to refuse partial rollouts for it")
        if index == len(calls):
            if self.left <= 0:
                raise SegmentCut
            calls.append(Call(prompt_digest=digest))
        call = calls[index]
        if call.finish_reason is None and self.left > 0:
            await self.advance(call, list(prompt_ids))
        if call.finish_reason is None:
            raise SegmentCut
        return Generation(list(call.token_ids), list(call.logprobs), call.finish_reason)

    async def advance(self, call: Call, prompt_ids: list[int]) -> None:
        """Sample the call's next tokens, at most what is left of the segment, from its exact ids."""
        context = prompt_ids + call.token_ids
        room = min(self.sampling.max_completion_tokens - len(call.token_ids),
                   self.runtime.config.max_model_len - len(context))  # what the whole call may still sample
        if room > 0:
            segment = await super().generate(context, max_tokens=min(self.left, room),
                                             seed=derive_seed(self.seed, "segment", self.record.sampled_tokens))
            call.token_ids += segment.token_ids
            call.logprobs += [float(np.float32(p)) for p in segment.logprobs]
            call.versions += [int(self.runtime.policy_step)] * len(segment.token_ids)
            self.left -= len(segment.token_ids)
            room -= len(segment.token_ids)
            if segment.finish_reason != "length":
                call.finish_reason = segment.finish_reason
        if call.finish_reason is None and room <= 0:
            call.finish_reason = "length"


def record_versions(traces: list[Trace], record: Rollout, env_name: str) -> None:
    """Set each branch's `policy_versions` from the rollout's calls: each run of sampled tokens is the completion of
    the call whose prompt is the branch's tokens before it (EnvError when no call is)."""
    calls: dict[str, list[Call]] = {}
    for call in record.calls:
        calls.setdefault(call.prompt_digest, []).append(call)
    for trace in traces:
        for branch in trace.branches:
            versions = np.full(len(branch), NOT_SAMPLED, np.int32)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], branch.sampled.astype(np.int8), [0]])))
            for start, end in zip(edges[::2], edges[1::2]):
                matching = calls.get(prompt_digest(branch.token_ids[:start].tolist()), [])
                call = matching.pop(0) if matching else None
                if call is None or call.token_ids != branch.token_ids[start:end].tolist():
                    raise EnvError(f"env {env_name!r}: trace {trace.agent!r} branch {branch.index} holds {end - start} "
                                   f"sampled tokens at {start} that no generate call of its rollout sampled after "
                                   "the tokens before them")
                versions[start:end] = call.versions
            branch.policy_versions = versions


def in_flight_path(storage: RunStorage, step: int) -> str:
    return storage.step_path(step, IN_FLIGHT)


def read_in_flight(storage: RunStorage, step: int) -> list[Rollout]:
    """The rollouts in flight after `step` (none before step 1); InFlightError when its file is missing or bad."""
    if step < 1:
        return []
    path = in_flight_path(storage, step)
    where = storage.url_of_path(path)
    fix = "restore it from a copy of the run, or start the run again (train --overwrite)"
    if not storage.exists(path):
        raise InFlightError(f"{where} is missing: step {step + 1} continues the rollouts step {step} left in flight; "
                            f"{fix}")
    try:
        stored = InFlight.model_validate_json(storage.read_bytes(path))
    except ValidationError as exc:
        raise InFlightError(f"{where} is not an in-flight store ({exc.errors()[0]['msg']}); {fix}") from None
    return stored.rollouts


def new_rollouts(config: Config, step: int) -> list[Rollout]:
    """The rollouts whose examples start at `step`: those of steps 1 .. 1 + AHEAD at step 1, else of step + AHEAD."""
    origins = range(1, 2 + AHEAD) if step == 1 else [step + AHEAD]
    return [Rollout(origin=origin, env_index=env_index, example_index=example_index, rollout=rollout)
            for origin in origins for env_index, env_config in enumerate(config.env)
            for example_index in range(env_config.batch_size) for rollout in range(env_config.group_size)]


class PartialSummary(RolloutSummary):
    in_flight: int = 0  # rollouts left in flight after the step (ended ones waiting to train included)
    carried_tokens: int = 0  # tokens the step's trained rollouts sampled in earlier steps
    rounds: int = 0  # segments the step advanced its unfinished rollouts by
    dropped_for_age: int = 0  # rollouts dropped for a token older than max_token_age (stale_tokens = 'drop')

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "partial/in_flight": float(self.in_flight),
                "partial/carried_tokens": float(self.carried_tokens), "partial/rounds": float(self.rounds),
                "async/dropped_for_age": float(self.dropped_for_age)}


async def play_partial_rollouts(config: Config, runtimes: Mapping[str, ModelRuntime], step: int,
                               storage: RunStorage) -> tuple[list[Trace], PartialSummary]:
    """The traces step `step` trains (each env's `batch_size` oldest ended groups) and its summary; the rollouts
    left in flight are written to `steps/<step>/in_flight.json`."""
    runtime = runtimes[config.actor]
    tokens = config.async_.partial_rollout_tokens
    names = env_names(config)
    envs = [load_env(e.id, e.args, e.import_paths, e.verifiers_server) for e in config.env]
    pool = read_in_flight(storage, step - 1) + new_rollouts(config, step)
    carried = {id(r): r.sampled_tokens for r in pool}
    examples: dict[tuple[int, int], list] = {}

    def example_of(record: Rollout):
        key = (record.origin, record.env_index)
        if key not in examples:
            examples[key] = envs[record.env_index].examples_for_step(
                config.seed, record.origin, record.env_index, config.env[record.env_index].batch_size)
        return examples[key][record.example_index]

    limit = asyncio.Semaphore(config.inference.max_concurrent)

    async def advance(record: Rollout) -> None:
        example = example_of(record)
        seed = derive_seed(config.seed, record.origin, record.env_index, record.example_index, record.rollout)
        sampler = SegmentSampler(runtime, config, record.env_index, record, seed, tokens)
        env = envs[record.env_index]
        async with limit:
            try:
                traces, retries = await run_rollout(env, example, sampler, max_retries=config.inference.max_retries,
                                                    backoff_s=config.inference.retry_backoff_s)
            except SegmentCut:
                return
        group_id = f"step{record.origin}-{names[record.env_index]}-{example.id}"
        record_versions(traces, record, names[record.env_index])
        newest = max((v for call in record.calls for v in call.versions), default=int(runtime.policy_step))
        label(traces, config.env[record.env_index].id, names[record.env_index], group_id, record.rollout, newest)
        record.traces = [trace.to_dict() for trace in traces]
        record.retries = retries

    def ended_groups() -> dict[int, list[list[Rollout]]]:
        groups: dict[tuple[int, int, int], list[Rollout]] = {}
        for record in pool:
            groups.setdefault((record.env_index, record.origin, record.example_index), []).append(record)
        by_env: dict[int, list[list[Rollout]]] = {i: [] for i in range(len(config.env))}
        for (env_index, *_), group in sorted(groups.items()):
            if all(r.traces is not None for r in group):
                by_env[env_index].append(sorted(group, key=lambda r: r.rollout))
        return by_env

    rounds = 0
    while rounds == 0 or any(len(groups) < config.env[i].batch_size for i, groups in ended_groups().items()):
        await gather_or_cancel([advance(r) for r in pool if r.traces is None])
        rounds += 1
    trained = [group for i, groups in ended_groups().items() for group in groups[:config.env[i].batch_size]]
    trained_ids = {id(r) for group in trained for r in group}
    left = [r for r in pool if id(r) not in trained_ids]
    storage.write_json(in_flight_path(storage, step), InFlight(step=step, rollouts=left).model_dump())

    records = [r for group in trained for r in group]
    rollouts = [[Trace.from_dict(t) for t in r.traces] for r in records]
    summary = PartialSummary(retries=sum(r.retries for r in records), in_flight=len(left), rounds=rounds,
                             carried_tokens=sum(carried[id(r)] for r in records))
    for env_index, name in enumerate(names):
        env_rollouts = [rollout for r, rollout in zip(records, rollouts) if r.env_index == env_index]
        summary.envs[name] = summarize(env_rollouts)
        check_error_fraction(config, env_index, name, step, summary.envs[name], env_rollouts)
    if config.async_.stale_tokens == "drop":
        summary.dropped_for_age = drop_stale(rollouts, step, config.token_age_bound)
    traces = [trace for rollout in rollouts for trace in rollout]
    summary.errors = list(dict.fromkeys(t.error for t in traces if t.error))[:MAX_LISTED_ERRORS]
    return traces, summary
