"""Partial rollouts (`[async] partial_rollout_tokens`) on a long-tail workload against sync and k = 1, interleaved.

The workload (`WORKLOAD`): the real SmolLM2-135M-Instruct (`smollm2-135m`, float32) on the in-process vLLM
engine, the `dataset` env over `long_tail_rows()`, not shuffled, so every step's 8 prompts hold exactly one story:
- 1 prompt in 8: "Write a story of about 600 words about <subject>." (`STORIES`). Measured before choosing it
  (16 completions, 2 per subject, temperature 0.7): 365 to 1024 tokens, median about 500, 5 of 16 at the 1024
  cap. Its reward (`story_reward`): half for naming the subject's word, half for ending on a finished sentence
  (a story cut at the cap does not).
- the other 7: "Count from 1 to n, separated by commas." with n from 10 down to 4 under the system prompt
  "Reply with the numbers only, separated by commas.": 4 to 88 tokens in the same measurement. Its reward
  (`counting_reward`): the length of the completion's correct prefix 1, 2, 3 ... (at most n) over the larger of
  n and how many numbers it wrote.
So 1 completion in 8 runs to several hundred tokens and the rest stay short. 8 prompts x 2 completions a step,
grpo, lr 2e-5, at most 1024 completion tokens at temperature 0.7. A 1024-token completion on a loaded 2-core
machine outlasts the sampler's default 120 s (`inference.request_timeout_s`), so the workload allows 900 s.

Why this tail: a synchronous step waits for its longest completion, decoded a token at a time at a batch of 1
or 2 (about 0.11 s a token on this machine's vLLM), while training costs about the same per trained token
whatever the lengths; a partial step waits for one segment of `PARTIAL_TOKENS`. What partial rollouts can save
grows with the tail's length over the segment's: up to 1024 tokens against a 256-token segment. An earlier
workload asked for a count to 140-160 as its long prompt; the model seldom counted that far, so its tail was
rare and the measured gain small (docs/benchmarks.md).

Sides (`SIDES`; `DEFAULT_SIDES` run unless `--sides` names others: each holds a vLLM engine and a trainer, about
7 GB, and four do not fit in 24 GB), each a real `train` flow run (`flows.train.run_training`) in a subprocess of
its own against one embedded Prefect server, with the same seed, examples and trainer:

- `sync`: `max_off_policy_steps = 0`, every rollout of a step sampled to its end before training;
- `k=1`: `max_off_policy_steps = 1`, step n + 1 sampled beside step n's training, rollouts still whole;
- `partial`: `partial_rollout_tokens = PARTIAL_TOKENS` (256) with `max_off_policy_steps = 0`: each step samples
  one segment of its rollouts with the weights it trains from, then trains, nothing beside it. A story is at
  most 1024 tokens, so it ends in at most 4 segments, one per step: its first tokens are at most 3 steps old when
  it trains, which `max_token_age = 3` allows, so no token is masked; a smaller N would need a larger bound and
  prefill each continued rollout more often, a larger one makes each step wait longer;
- `partial k=1`: the same segments with `max_off_policy_steps = 1`, step n + 1's segment sampled beside step n's
  training with the weights of step n - 1. Its tokens are a step older than on `partial` (a segment's tokens
  are 1 step old when sampled), so a 4-segment story's first tokens are 4 steps old: `max_token_age = 4` keeps
  them (the default, k + 4 segments = 5, one step more).

The sides are interleaved step by step (bench/trl.py's `Side`: one side's step at a time, the order rotating),
so a shared machine's load hits all alike. Each run is `steps + 1` steps long and stopped before its last one,
so every measured step of the k = 1 sides samples the next one beside its training, as in the middle of a run;
no checkpoints (the same on every side), the weights exported every step for the sampler. Figures are over the
steps after `warmup_steps` (3): step 1 loads the models (and with k = 1 samples ahead alone), and the partial
sides fill their pipeline until step 4, when the first stories (up to 4 segments, from step 1) can end; until
then they train only counts, short batches no steady state has. In turn the window trains stories whose first
segments the warm-up sampled (`partial/carried_tokens`), so a partial side may train more tokens a step in it
than it samples; the report gives the tokens trained a step of every side:

- trained sampled tokens per second: the steps' `batch/rl_tokens` (sampled tokens that carry the rl loss, age-
  masked ones excluded) over the steps' wall time; steps per second;
- where the time goes: the median of each `time/*` key of metrics.json (sampling, wherever it ran; the stages;
  `wait_for_sampling`, training idle for the sampling beside it) and of the `partial/*` and `async/*` keys
  (segments per step, rollouts in flight, tokens carried over, token age), CPU seconds of the side's processes;
- the reward of every trained group (its mean over the group's completions), side by side by group: every side
  trains the same examples (the partial side later, when its long rollouts end), so the groups trained on all
  sides are compared one to one, long and short apart.

    python -m bench.partial [--steps 7] [--sides sync partial]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

from bench.trl import END, ROW, Side, interleave, report, tree_cpu_seconds, wait_for_turn

STEPS = 7
PARTIAL_TOKENS = 256
STORIES = (  # (subject, the word a story about it names)
    ("a dragon who learns to read", "dragon"), ("a lighthouse keeper who finds a message in a bottle", "lighthouse"),
    ("a robot who wants to become a gardener", "robot"), ("two friends lost in a snowy forest", "snow"),
    ("a cat who runs a bakery", "cat"), ("a girl who builds a boat to cross the sea", "boat"),
    ("an old clockmaker and his last clock", "clock"), ("a village that forgets how to sing", "village"))
WORKLOAD = {
    "model": "smollm2-135m", "dtype": "float32", "prompts_per_step": 8, "group_size": 2, "long_every": 8,
    "short_n": (4, 10), "story_words": 600, "rows": 64, "max_completion_tokens": 1024, "max_model_len": 1152,
    "temperature": 0.7, "lr": 2e-5, "micro_batch_tokens": 1152, "request_timeout_s": 900.0, "warmup_steps": 3,
    "system_prompt": "Reply with the numbers only, separated by commas.",
}
SIDES = {  # overrides of the workload's config
    "sync": {"max_off_policy_steps": 0},
    "k=1": {"max_off_policy_steps": 1},
    "partial": {"max_off_policy_steps": 0, "partial_rollout_tokens": PARTIAL_TOKENS, "max_token_age": 3},
    "partial k=1": {"max_off_policy_steps": 1, "partial_rollout_tokens": PARTIAL_TOKENS, "max_token_age": 4},
}
TARGET = ("partial", "sync")  # the pair the 1.5x is about; every other ratio is reported
# each side holds a vLLM engine and a trainer, about 7 GB: a fourth side does not fit in 24 GB beside them
DEFAULT_SIDES = ("sync", "partial", "partial k=1")
ENV = "dataset"
NUMBER = re.compile(r"\d+")


def long_tail_rows(workload: dict = WORKLOAD) -> list[dict]:
    """The dataset's rows (`messages`, `answer`): every `long_every`-th asks for a story, the others for a count."""
    rows, every = [], workload["long_every"]
    for i in range(workload["rows"]):
        if i % every == 0:
            subject, word = STORIES[i // every % len(STORIES)]
            messages = [{"role": "user",
                         "content": f"Write a story of about {workload['story_words']} words about {subject}."}]
            rows.append({"messages": messages, "answer": word})
        else:  # 10, 9, ... 4 in each run of 8 rows
            n = workload["short_n"][1] + 1 - i % every
            rows.append({"messages": [{"role": "system", "content": workload["system_prompt"]},
                                      {"role": "user", "content": f"Count from 1 to {n}, separated by commas."}],
                         "answer": ", ".join(str(x) for x in range(1, n + 1))})
    return rows


def is_story(answer: str) -> bool:
    """Whether a row's answer is a story's word (else it is the count 1, 2, ... n)."""
    return not answer[:1].isdigit()


def counting_reward(completion: str, answer: str) -> float:
    """The correct prefix of the completion's numbers (1, 2, 3 ...) over the larger of n and the numbers written."""
    n = len(answer.split(","))
    numbers = [int(x) for x in NUMBER.findall(completion)]
    correct = next((i for i, x in enumerate(numbers[:n]) if x != i + 1), min(n, len(numbers)))
    return correct / max(n, len(numbers))


def story_reward(completion: str, word: str) -> float:
    """Half for naming the story's subject (`word`, any case), half for ending on a finished sentence."""
    ends = completion.rstrip().rstrip("\"'*)").endswith((".", "!", "?"))
    return 0.5 * (word.lower() in completion.lower()) + 0.5 * ends


def long_tail_reward(completion: str, answer: str) -> float:
    """The row's reward: `story_reward` for a story, `counting_reward` for a count."""
    return story_reward(completion, answer) if is_story(answer) else counting_reward(completion, answer)


def side_config(side: str, data: str, storage: str, steps: int, workload: dict = WORKLOAD):
    from trace_rl.config import Config

    w = workload
    return Config(
        name=f"bench-partial-{side.replace('=', '').replace(' ', '-')}", steps=steps + 1, seed=0, storage=storage,
        model={"name": w["model"], "dtype": w["dtype"]},
        inference={"backend": "vllm", "max_model_len": w["max_model_len"], "request_timeout_s": w["request_timeout_s"]},
        sampling={"max_completion_tokens": w["max_completion_tokens"], "temperature": w["temperature"]},
        env=[{"id": ENV, "batch_size": w["prompts_per_step"], "group_size": w["group_size"],
              "args": {"path": data, "shuffle": False, "reward": "bench.partial:long_tail_reward",
                       "messages_column": "messages"}}],
        algorithms=["grpo"], async_=SIDES[side],
        trainer={"lr": w["lr"], "micro_batch_tokens": w["micro_batch_tokens"]},
        ckpt={"interval": steps + 100, "keep_weights_every": 0},
    )


class Stop(Exception):
    """Raised at the run's last step: the side has run its measured steps."""


def group_rewards(storage, step: int) -> dict[str, dict]:
    """Each trained group of the step: its mean reward, whether it is a story (long), its mean completion tokens."""
    from trace_rl.tables import read_traces

    groups: dict[str, list] = {}
    for trace in read_traces(storage, step):
        groups.setdefault(trace.group_id, []).append(trace)
    return {group_id: {
        "reward": statistics.mean(t.reward for t in traces), "step": step,
        "long": is_story(traces[0].info["answer"]),
        "completion_tokens": statistics.mean(int(b.sampled.sum()) for t in traces for b in t.branches)}
        for group_id, traces in groups.items()}


def side_main(side: str, steps: int, data: str, storage: str) -> None:
    import flows.train
    from trace_rl.inference.vllm_engine import shutdown_engines
    from trace_rl.storage import RunStorage

    config = side_config(side, data, storage, steps)
    run_storage = RunStorage.of(config)
    subflow = flows.train.step_flow
    stopped = []

    def gated_step(config, step, **kwargs):
        if step > steps:
            stopped.append(step)
            raise Stop
        wait_for_turn()
        started, cpu = time.perf_counter(), tree_cpu_seconds()
        result = subflow(config, step, **kwargs)
        wall, cpu = time.perf_counter() - started, tree_cpu_seconds() - cpu
        report(ROW, {"step": step, "wall": wall, "cpu": cpu, "load": os.getloadavg()[0],
                     "metrics": {k: v for k, v in result["metrics"].items() if isinstance(v, (int, float))},
                     "groups": group_rewards(run_storage, step)})
        return result

    flows.train.step_flow = gated_step
    try:
        flows.train.run_training(config)
    except Exception:  # the flow may hand Stop back wrapped; anything else is the side's error
        if not stopped:
            raise
    finally:
        shutdown_engines()
    report(END, {})


KEYS = ("partial/rounds", "partial/in_flight", "partial/carried_tokens", "async/token_age_mean", "async/token_age_max",
        "batch/age_masked_tokens", "async/policy_lag_mean")


def summarize(rows: list[dict]) -> dict:
    """Over the steps after the warm-up: throughput, medians of the `time/*` and partial keys, rewards by group."""
    warm = rows[WORKLOAD["warmup_steps"]:]
    seconds = sum(r["wall"] for r in warm)
    tokens = sum(r["metrics"]["batch/rl_tokens"] for r in warm)
    times = sorted({k for r in warm for k in r["metrics"] if k.startswith("time/")})
    reward_key = f"rollouts/{ENV}/reward_mean"
    groups = {g: v for r in rows for g, v in r["groups"].items()}
    return {
        "trained_tokens_per_s": tokens / seconds, "steps_per_s": len(warm) / seconds,
        "step_seconds": statistics.median(r["wall"] for r in warm),
        "step_cpu_seconds": statistics.median(r["cpu"] for r in warm), "first_step_seconds": rows[0]["wall"],
        "trained_tokens_per_step": tokens / len(warm),
        "time": {k.removeprefix("time/"): statistics.median(r["metrics"].get(k, 0.0) for r in warm) for k in times},
        "partial": {k: statistics.median(r["metrics"].get(k, 0.0) for r in warm) for k in KEYS},
        "rewards": [r["metrics"][reward_key] for r in rows],
        "groups": groups,
        "completion_tokens": {kind: statistics.mean(g["completion_tokens"] for g in groups.values() if g["long"] == long)
                              for kind, long in (("long", True), ("short", False))},
        "loads": [r["load"] for r in rows],
    }


class PartialSide(Side):
    def summarize(self, end: dict) -> dict:
        return summarize(self.rows)


def compare_groups(sides: dict) -> dict:
    """The groups every side trained, their rewards side by side; means over them, long and short apart."""
    common = sorted(set.intersection(*(set(s["groups"]) for s in sides.values())),
                    key=lambda g: (int(g.split("-")[0].removeprefix("step")), g))
    rows = [{"group": g, "long": sides["sync"]["groups"][g]["long"],
             **{name: s["groups"][g]["reward"] for name, s in sides.items()},
             **{f"{name} step": s["groups"][g]["step"] for name, s in sides.items()}} for g in common]
    means = {}
    for kind, keep in (("all", lambda r: True), ("long", lambda r: r["long"]), ("short", lambda r: not r["long"])):
        chosen = [r for r in rows if keep(r)]
        means[kind] = {name: statistics.mean(r[name] for r in chosen) if chosen else float("nan") for name in sides}
        means[kind]["groups"] = len(chosen)
    return {"rows": rows, "means": means}


def run(steps: int = STEPS, sides: tuple[str, ...] = DEFAULT_SIDES) -> dict:
    from bench.step import use_private_prefect

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-partial-") as home:
        use_private_prefect(home)
        from flows import prefect_server

        server = prefect_server.start()
        os.environ["PREFECT_API_URL"] = server["api_url"]
        data = os.path.join(home, "long_tail.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in long_tail_rows())
        try:
            results = interleave([PartialSide(side, steps, home, command=[
                sys.executable, "-m", "bench.partial", "--side", side, "--steps", str(steps), "--data", data,
                "--storage", os.path.join(home, "runs")]) for side in sides], steps)
        finally:
            prefect_server.stop()
    done = {name: s for name, s in results.items() if "error" not in s}
    ratios = {}
    for ours, theirs in (TARGET, ("partial k=1", "sync"), ("k=1", "sync"), ("partial", "k=1")):
        if ours in done and theirs in done:
            ratios[f"{ours} / {theirs}"] = {
                "trained_tokens_per_s": done[ours]["trained_tokens_per_s"] / done[theirs]["trained_tokens_per_s"],
                "steps_per_s": done[ours]["steps_per_s"] / done[theirs]["steps_per_s"]}
    loads = [x for s in done.values() for x in s["loads"]]
    return {"workload": WORKLOAD, "side_configs": {side: SIDES[side] for side in sides}, "steps": steps,
            "sides": results,
            "ratios": ratios, "groups": compare_groups(done) if "sync" in done and len(done) > 1 else None,
            "target": 1.5, "load_before": load_before,
            "load_average": statistics.median(loads) if loads else os.getloadavg()[0],
            "load_range": [min(loads), max(loads)] if loads else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(DEFAULT_SIDES))
    parser.add_argument("--json", help="also write the full result here")
    parser.add_argument("--side", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side_main(args.side, args.steps, args.data, args.storage)
        return
    result = run(args.steps, tuple(args.sides))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "groups"}, indent=1, default=str))


if __name__ == "__main__":
    main()
