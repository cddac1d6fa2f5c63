"""Held-out evaluation of the policy's weights of one step (`[eval]`, docs/eval.md).

Each `[[eval.envs]]` env gives `num_examples` examples, each sampled `k` times with the eval sampling
settings. A sample is correct when it has no error and its reward is at least `pass_reward`; with c
correct of k samples per example the env reports mean reward, avg@k and pass@j for j in {1, k/2, k}
(`trace_rl.eval.passk`), the mean completion length in sampled tokens and the fraction of failed samples.

Eval draws nothing from training's randomness: its examples and sampling seeds derive from
(run seed, "eval", env, example, sample), the samplers seed every request themselves, and nothing
of the trainer is touched; so a run's weights are the same with and without eval.

Results go to `eval/step_<step>/` (traces.parquet, samples.parquet, metrics.parquet, and settings.json:
`eval_settings`), marked STABLE last; a finished eval with the same settings is read back instead of
being run again, one with other settings is run again and replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pyarrow as pa

from trace_rl.config import Config, EnvConfig, EvalConfig
from trace_rl.data.trace import Trace
from trace_rl.envs.base import Environment, Example, Sampler, derive_seed
from trace_rl.envs.lookup import load_env
from trace_rl.errors import RefusedError
from trace_rl.eval.passk import avg_at_k, mean_pass_at_k, pass_k_values
from trace_rl.names import POLICY
from trace_rl.pipeline.rollouts import distinct_names, run_rollout
from trace_rl.pipeline.session import Session
from trace_rl.storage import RunStorage, eval_dir, step_name
from trace_rl.tables import read_table, traces_to_table, write_table

EVAL_SEED = "eval"


def evaluates_at(config: Config, step: int) -> bool:
    """Whether training evaluates after `step`: every `interval` steps, and always after the last one."""
    if config.eval is None:
        return False
    interval = config.eval.interval
    return step == config.steps or (interval > 0 and step % interval == 0)


def check_eval(config: Config, step: int) -> None:
    """RefusedError unless the config has `[eval]` and the weights of `step` exist (checked before any flow run)."""
    if config.eval is None:
        raise RefusedError(f"{config.name}: the run's config has no [eval] section; add one with --set, e.g. "
                           "--set 'eval={envs=[{id=\"reverse-text\"}]}' (docs/eval.md)")
    storage = RunStorage.of(config)
    if step < 0 or (step > 0 and not storage.is_stable(storage.path("weights", step_name(step)))):
        done = storage.stable_steps("weights")
        raise RefusedError(f"--step {step}: {storage.url} has no finished weights of that step; use 0 (the base "
                           f"model) or one of {done}")


def eval_settings(config: Config) -> dict:
    """What an eval's numbers depend on besides the weights: `[eval]`, the sampling it uses and the run seed."""
    evaluation: EvalConfig = config.eval
    return {"eval": evaluation.model_dump(mode="json", exclude={"interval"}),
            "sampling": (evaluation.sampling or config.sampling).model_dump(mode="json"), "seed": config.seed}


def finished_eval(config: Config, storage: RunStorage, step: int) -> list[dict] | None:
    """The metrics rows of a finished (STABLE) eval of `step` with these settings, else None."""
    directory = eval_dir(storage, step)
    if not storage.is_stable(directory):
        return None
    settings = f"{directory}/settings.json"
    if not storage.exists(settings) or storage.read_json(settings) != eval_settings(config):
        return None  # evaluated with other [eval] settings (or before they were recorded): run again, replace it
    return read_table(storage, f"{directory}/metrics.parquet").to_pylist()


def completion_tokens(trace: Trace) -> int:
    return int(sum(branch.sampled.sum() for branch in trace.branches))


def score_rollout(traces: list[Trace], pass_reward: float) -> dict:
    """One sample's numbers: its trainable traces' mean reward (every trace's if none is trainable)."""
    scored = [t for t in traces if t.trainable] or traces
    error = next((t.error for t in traces if t.error), None)
    reward = sum(t.reward for t in scored) / len(scored) if error is None else 0.0
    return {"reward": reward, "correct": error is None and reward >= pass_reward,
            "completion_tokens": sum(completion_tokens(t) for t in scored), "error": error}


def env_metrics(name: str, step: int, k: int, samples: list[dict]) -> dict:
    """The metrics row of one env from its sample rows (num_examples x k, in example order)."""
    by_example: dict[str, list[dict]] = {}
    for sample in samples:
        by_example.setdefault(sample["example_id"], []).append(sample)
    correct = [sum(s["correct"] for s in group) for group in by_example.values()]
    ok = [s for s in samples if s["error"] is None]
    row = {"env": name, "step": step, "examples": len(by_example), "k": k,
           "reward_mean": sum(s["reward"] for s in ok) / len(ok) if ok else 0.0,
           "avg@k": avg_at_k(k, correct)}
    row.update({f"pass@{j}": mean_pass_at_k(k, correct, j) for j in pass_k_values(k)})
    row["completion_tokens_mean"] = sum(s["completion_tokens"] for s in ok) / len(ok) if ok else 0.0
    row["error_fraction"] = (len(samples) - len(ok)) / len(samples) if samples else 0.0
    return row


async def sample_env(config: Config, runtime, env_index: int, name: str, env_config: EnvConfig,
                     done: Callable[[], None]) -> tuple[list[Trace], list[dict]]:
    """Every sample of one eval env: its traces (with ids) and one row per sample."""
    evaluation: EvalConfig = config.eval
    env: Environment = load_env(env_config.id, env_config.args, env_config.import_paths,
                                env_config.verifiers_server, env_config.select)
    run_seed = derive_seed(config.seed, EVAL_SEED)
    examples = env.examples_for_step(run_seed, 1, env_index, evaluation.num_examples)
    sampling = evaluation.sampling or config.sampling
    limit = asyncio.Semaphore(config.inference.max_concurrent)

    async def one(example_index: int, example: Example, sample: int) -> tuple[list[Trace], dict]:
        seed = derive_seed(run_seed, env_index, example_index, sample)
        sampler = Sampler(runtime, sampling, seed, timeout_s=config.inference.request_timeout_s)
        async with limit:
            traces, _ = await run_rollout(env, example, sampler, max_retries=config.inference.max_retries,
                                          backoff_s=config.inference.retry_backoff_s)
        group_id = f"eval-{name}-{example.id}"
        for trace in traces:
            trace.env, trace.group_id = env_config.id, group_id
            trace.id = f"{group_id}-s{sample}-{trace.agent}"
            trace.policy_step = int(getattr(runtime, "policy_step", 0))
            for branch in trace.branches:  # every eval token is sampled by the weights evaluated, uncut
                branch.policy_versions = branch.versions_or(trace.policy_step)
        done()
        return traces, {"env": name, "example_id": example.id, "sample": sample,
                        **score_rollout(traces, evaluation.pass_reward)}

    results = await asyncio.gather(*[one(i, example, sample) for i, example in enumerate(examples)
                                     for sample in range(evaluation.k)])
    return [t for traces, _ in results for t in traces], [row for _, row in results]


async def evaluate(session: Session, step: int, progress: Callable[[int, int], None] | None = None) -> dict:
    """Evaluate the weights of `step` (0: the base model): {"metrics": rows per env, "reused": bool}.

    `progress(done, total)` is called after each sample (for a progress bar)."""
    config, storage = session.config, session.storage
    finished = finished_eval(config, storage, step)
    if finished is not None:
        return {"metrics": finished, "reused": True}
    await session.load_policy(step)  # weights/<step> itself, whatever [async] samples the next step with
    runtime = session.runtimes[POLICY]
    envs = config.eval.envs
    total, counter = len(envs) * config.eval.num_examples * config.eval.k, [0]

    def done() -> None:
        counter[0] += 1
        if progress is not None:
            progress(counter[0], total)

    names = distinct_names([env.id for env in envs])
    traces: list[Trace] = []
    samples: list[dict] = []
    rows = []
    for env_index, (name, env_config) in enumerate(zip(names, envs)):
        env_traces, env_samples = await sample_env(config, runtime, env_index, name, env_config, done)
        traces += env_traces
        samples += env_samples
        rows.append(env_metrics(name, step, config.eval.k, env_samples))
    directory = eval_dir(storage, step)
    storage.remove(directory)  # an earlier attempt's unmarked files
    write_table(storage, f"{directory}/traces.parquet", traces_to_table(traces))
    write_table(storage, f"{directory}/samples.parquet", pa.Table.from_pylist(samples))
    write_table(storage, f"{directory}/metrics.parquet", pa.Table.from_pylist(rows))
    storage.write_json(f"{directory}/settings.json", eval_settings(config))
    storage.mark_stable(directory)
    return {"metrics": rows, "reused": False}


def tracker_metrics(rows: list[dict]) -> dict[str, float]:
    """Eval rows as flat tracker metrics: `eval/<env>/<metric>`."""
    return {f"eval/{row['env']}/{key}": float(value) for row in rows for key, value in row.items()
            if key not in ("env", "step")}
