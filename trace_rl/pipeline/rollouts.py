"""The rollout loop: every env's examples x group_size rollouts with the actor, as traces.

Seeds are derived from (config.seed, step, env index, example index, rollout index), so a
step samples the same traces whenever it runs with the same weights. A retryable error
(`RetryableError`, `TimeoutError`, a transient HTTP failure) reruns the rollout after an
exponential backoff, up to `inference.max_retries` times; any other error, or retries run
out, gives one trace marked with `error` (kept in traces.parquet, never trained). Groups whose
rollouts all failed are listed in the summary and logged; when more than `[[env]]
max_error_fraction` of an env's rollouts failed, the stage fails with `RolloutError` showing the
first errors. A `FatalError` (the sampler's engine died) fails the whole stage at once.

With `[[env]] drop_uniform_groups`, the env's groups whose rewards are all equal are dropped before the
algorithms, and `refill_rounds` more rounds of fresh groups, seeded by (step, round), refill the batch
(`dynamic_sampling`; docs/algorithms.md).

Every trace id is unique: an agent's further traces of one rollout (a seat played several times) are numbered
(`rollout_trace_id`); ids that still collide, or the same example id twice in a step, raise `TraceError` instead of
having their traces merged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import httpx
import numpy as np
from pydantic import BaseModel

from trace_rl.aio import gather_or_cancel
from trace_rl.config import Config
from trace_rl.data.trace import Trace, TraceError, group_traces, rollout_trace_id
from trace_rl.envs.base import Environment, Example, Sampler, derive_seed
from trace_rl.envs.lookup import load_env
from trace_rl.errors import FatalError, RetryableError
from trace_rl.models.runtime import ModelRuntime

logger = logging.getLogger(__name__)
MAX_LISTED_ERRORS = 20
MAX_SHOWN_ERRORS = 3  # in a RolloutError's message


class RolloutError(RuntimeError):
    """Too many of an env's rollouts failed (`[[env]] max_error_fraction`); the message shows the first errors."""


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, (RetryableError, TimeoutError, httpx.TimeoutException, httpx.TransportError)):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and (
        exc.response.status_code >= 500 or exc.response.status_code == 429
    )


class EnvSummary(BaseModel):
    traces: int = 0
    errors: int = 0
    rollouts: int = 0
    error_fraction: float = 0.0  # of the rollouts: those with an error trace
    reward_mean: float = 0.0
    reward_std: float = 0.0
    failed_groups: list[str] = []
    metric_means: dict[str, float] = {}  # each trace metric's mean over the error-free traces that report it
    # dynamic sampling (`[[env]] drop_uniform_groups`, `refill_rounds`); reported only when it is on
    dynamic: bool = False
    groups: int = 0  # groups kept for the algorithms
    dropped_groups: int = 0  # groups dropped for uniform rewards, over every round
    refill_rounds: int = 0  # further rounds sampled to refill the batch


class RolloutSummary(BaseModel):
    envs: dict[str, EnvSummary] = {}
    retries: int = 0
    errors: list[str] = []  # the first distinct error messages

    def metrics(self) -> dict[str, float]:
        """Flat numbers for metrics.json: `rollouts/<env>/<name>`, the means of the traces' own metrics as
        `rollouts/<env>/metrics/<metric>`, and `rollouts/retries`."""
        out: dict[str, float] = {"rollouts/retries": float(self.retries)}
        for env, summary in self.envs.items():
            out.update({f"rollouts/{env}/{name}": float(getattr(summary, name))
                        for name in ("traces", "errors", "error_fraction", "reward_mean", "reward_std")})
            out[f"rollouts/{env}/failed_groups"] = float(len(summary.failed_groups))
            out.update({f"rollouts/{env}/metrics/{name}": mean for name, mean in summary.metric_means.items()})
            if summary.dynamic:
                out.update({f"rollouts/{env}/{name}": float(getattr(summary, name))
                            for name in ("groups", "dropped_groups", "refill_rounds")})
        return out


async def run_rollout(
    env: Environment, example: Example, sampler: Sampler, *, max_retries: int, backoff_s: float
) -> tuple[list[Trace], int]:
    """The rollout's traces and how many retries it took; on failure one trace carrying the error."""
    for attempt in range(max_retries + 1):
        try:
            sampler.begin_rollout()
            traces = await env.rollout(example, sampler)
            if not traces or not all(isinstance(t, Trace) for t in traces):
                raise TypeError(f"{type(env).__name__}.rollout must return a non-empty list of Trace")
            return traces, attempt
        except FatalError:
            raise
        except Exception as exc:  # noqa: BLE001  (every failure becomes a trace error or a retry)
            if is_retryable(exc) and attempt < max_retries:
                await asyncio.sleep(backoff_s * 2**attempt)
                continue
            reason = f"{type(exc).__name__}: {exc}"
            if is_retryable(exc):
                reason = f"gave up after {attempt + 1} attempts: {reason}"
            failed = Trace(id="", env=env.id, example_id=example.id, group_id="", error=reason)
            return [failed], attempt
    raise AssertionError("unreachable")


async def play_rollouts(
    config: Config, runtimes: Mapping[str, ModelRuntime], step: int
) -> tuple[list[Trace], RolloutSummary]:
    runtime = runtimes[config.actor]
    policy_step = int(getattr(runtime, "policy_step", 0))
    limit = asyncio.Semaphore(config.inference.max_concurrent)
    names = env_names(config)

    async def one(env: Environment, env_index: int, example_index: int, example: Example, rollout: int,
                  round_: int):
        sampling = config.sampling_for(config.env[env_index])
        if round_ == 0:
            seed = derive_seed(config.seed, step, env_index, example_index, rollout)
            group_id = f"step{step}-{names[env_index]}-{example.id}"
        else:  # a refill round (dynamic sampling): its own seeds and group ids
            seed = derive_seed(config.seed, step, env_index, "refill", round_, example_index, rollout)
            group_id = f"step{step}-{names[env_index]}-refill{round_}-{example.id}"
        sampler = Sampler(runtime, sampling, seed, timeout_s=config.inference.request_timeout_s)
        async with limit:
            traces, retries = await run_rollout(
                env, example, sampler,
                max_retries=config.inference.max_retries, backoff_s=config.inference.retry_backoff_s,
            )
        label(traces, config.env[env_index].id, names[env_index], group_id, rollout, policy_step)
        return env_index, traces, retries

    def round_jobs(env: Environment, env_index: int, examples: list[Example], round_: int) -> list:
        example_ids = [example.id for example in examples]
        if len(set(example_ids)) < len(example_ids):
            twice = sorted({i for i in example_ids if example_ids.count(i) > 1})
            raise TraceError(f"env {names[env_index]!r} returned the example ids {', '.join(map(repr, twice))} more "
                             "than once in one step; their groups would merge: give each example its own id")
        return [one(env, env_index, example_index, example, rollout, round_)
                for example_index, example in enumerate(examples)
                for rollout in range(config.env[env_index].group_size)]

    envs = [load_env(env_config.id, env_config.args, env_config.import_paths, env_config.verifiers_server,
                     env_config.select) for env_config in config.env]
    jobs = []
    for env_index, env_config in enumerate(config.env):
        examples = envs[env_index].examples_for_step(config.seed, step, env_index, env_config.batch_size)
        jobs += round_jobs(envs[env_index], env_index, examples, 0)
    sampled = await gather_or_cancel(jobs)  # every rollout of every round, for the summary
    results, rounds = await dynamic_sampling(config, step, sampled, envs, round_jobs)

    traces = [trace for _, env_traces, _ in results for trace in env_traces]
    summary = RolloutSummary(retries=sum(retries for *_, retries in sampled))
    for env_index, name in enumerate(names):
        rollouts = [env_traces for i, env_traces, _ in sampled if i == env_index]
        summary.envs[name] = summarize(rollouts)
        for group_id in summary.envs[name].failed_groups:
            logger.warning("step %d: every rollout of group %s failed", step, group_id)
        check_error_fraction(config, env_index, name, step, summary.envs[name], rollouts)
        if config.env[env_index].drop_uniform_groups:
            kept = len({env_traces[0].group_id for i, env_traces, _ in results if i == env_index})
            summary.envs[name] = summary.envs[name].model_copy(update={
                "dynamic": True, "groups": kept, "refill_rounds": rounds[env_index],
                "dropped_groups": len({traces[0].group_id for traces in rollouts}) - kept})
    summary.errors = list(dict.fromkeys(t.error for t in traces if t.error))[:MAX_LISTED_ERRORS]
    return traces, summary


def label(traces: list[Trace], env_id: str, name: str, group_id: str, rollout: int, policy_step: int) -> None:
    """Fill in what the rollout loop owns: env, group and trace ids, the sampling weights and each branch's
    per-token versions (where the rollout did not record them: `policy_step`). An agent's further traces of the
    rollout are numbered (`rollout_trace_id`); TraceError when two ids still collide."""
    plays: dict[str, int] = {}
    for trace in traces:
        trace.env = env_id
        trace.group_id = group_id
        trace.id = rollout_trace_id(group_id, rollout, trace.agent, plays.get(trace.agent, 0))
        plays[trace.agent] = plays.get(trace.agent, 0) + 1
        trace.policy_step = policy_step
        for branch in trace.branches:
            branch.policy_versions = branch.versions_or(policy_step)
    ids = [trace.id for trace in traces]
    if len(set(ids)) < len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise TraceError(
            f"env {name!r} returned traces whose ids collide in one rollout (trace ids "
            f"{', '.join(map(repr, twice))}): an agent named like another's further play (`<agent>-<n>`); "
            "rename that agent"
        )


def uniform_group(traces: list[Trace]) -> bool:
    """A group whose rollouts that did not fail all have the same reward (no advantage signal); a group whose
    rollouts all failed is not uniform (it is reported as failed instead)."""
    rewards = {t.reward for t in traces if t.error is None}
    return len(rewards) == 1


async def dynamic_sampling(config: Config, step: int, sampled: list, envs: list[Environment],
                           round_jobs) -> tuple[list, dict[int, int]]:
    """The rollouts the algorithms get: with `[[env]] drop_uniform_groups`, the env's groups of uniform reward are
    dropped; with `refill_rounds = N`, up to N further rounds each sample as many fresh groups as are missing
    (`Environment.refill_examples`, seeded by step and round: a resumed step samples the same ones) until the
    env has `batch_size` groups. Every rollout sampled is appended to `sampled` (for the summary). Returns the
    kept rollouts, in env, round and group order, and the refill rounds each dropping env sampled."""
    dropping = [i for i, env in enumerate(config.env) if env.drop_uniform_groups]
    rounds = {i: 0 for i in dropping}
    if not dropping:
        return list(sampled), rounds
    kept = [result for result in sampled if result[0] not in dropping]

    def keep(results: list) -> dict[int, list]:
        """The results whose group is not uniform, by env."""
        by_group: dict[tuple[int, str], list] = {}
        for result in results:
            by_group.setdefault((result[0], result[1][0].group_id), []).append(result)
        out: dict[int, list] = {}
        for (env_index, _), group in by_group.items():
            if not uniform_group([t for _, traces, _ in group for t in traces]):
                out.setdefault(env_index, []).extend(group)
        return out

    def groups(results: list) -> int:
        return len({result[1][0].group_id for result in results})

    by_env = keep([result for result in sampled if result[0] in dropping])
    for round_ in range(1, max(config.env[i].refill_rounds for i in dropping) + 1):
        jobs = []
        for env_index in dropping:
            env_config = config.env[env_index]
            missing = env_config.batch_size - groups(by_env.get(env_index, []))
            if missing > 0 and round_ <= env_config.refill_rounds:
                examples = envs[env_index].refill_examples(config.seed, step, env_index, round_, missing)
                jobs += round_jobs(envs[env_index], env_index, examples, round_)
                rounds[env_index] = round_
        if not jobs:
            break
        results = await gather_or_cancel(jobs)
        sampled += results
        for env_index, more in keep(results).items():
            by_env.setdefault(env_index, []).extend(more)
    for env_index in dropping:
        kept += by_env.get(env_index, [])
    return sorted(kept, key=lambda result: result[0]), rounds  # stable: each env's rounds and groups in order


def check_error_fraction(config: Config, env_index: int, name: str, step: int, summary: EnvSummary,
                         rollouts: list[list[Trace]]) -> None:
    limit = config.env[env_index].max_error_fraction
    if summary.error_fraction <= limit:
        return
    errors = list(dict.fromkeys(t.error for traces in rollouts for t in traces if t.error))
    shown = "\n".join(f"  - {error[:500]}" for error in errors[:MAX_SHOWN_ERRORS])
    more = f"\n  ({len(errors) - MAX_SHOWN_ERRORS} more distinct errors)" if len(errors) > MAX_SHOWN_ERRORS else ""
    failed = sum(any(t.error is not None for t in traces) for traces in rollouts)
    raise RolloutError(
        f"step {step}: env {name!r}: {failed} of {summary.rollouts} rollouts failed ({summary.error_fraction:.0%}, "
        f"more than env.{env_index}.max_error_fraction = {limit:g}); first errors:\n{shown}{more}\n"
        f"fix the env or the sampler, or raise env.{env_index}.max_error_fraction to train on the rest"
    )


def env_names(config: Config) -> list[str]:
    """Env ids, with `#<index>` appended where the same id appears more than once."""
    return distinct_names([env.id for env in config.env])


def distinct_names(ids: list[str]) -> list[str]:
    """The ids, with `#<index>` appended where one appears more than once."""
    return [env_id if ids.count(env_id) == 1 else f"{env_id}#{i}" for i, env_id in enumerate(ids)]


def summarize(rollouts: list[list[Trace]]) -> EnvSummary:
    """One env's numbers from its rollouts' traces (a rollout failed when one of its traces has an error)."""
    traces = [trace for rollout in rollouts for trace in rollout]
    rewards = np.array([t.reward for t in traces if t.error is None], dtype=np.float64)
    failed = [gid for gid, group in group_traces(traces).items() if all(t.error for t in group)]
    failed_rollouts = sum(any(t.error is not None for t in rollout) for rollout in rollouts)
    reported: dict[str, list[float]] = {}
    for trace in traces:
        if trace.error is None:
            for name, value in trace.metrics.items():
                reported.setdefault(name, []).append(value)
    return EnvSummary(
        traces=len(traces), errors=sum(t.error is not None for t in traces), rollouts=len(rollouts),
        error_fraction=failed_rollouts / len(rollouts) if rollouts else 0.0,
        reward_mean=float(rewards.mean()) if rewards.size else 0.0,
        reward_std=float(rewards.std()) if rewards.size else 0.0,
        failed_groups=failed, metric_means={name: float(np.mean(values)) for name, values in reported.items()},
    )
