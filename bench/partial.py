"""Partial rollouts (`[async] partial_rollout_tokens`) on a long-tail workload against sync and k = 1, interleaved.

The workload (`WORKLOAD`): the real SmolLM2-135M-Instruct (`smollm2-135m`, float32) on the in-process vLLM
engine, the `dataset` env over `long_tail_rows()`: "Count from 1 to n, separated by commas." (system prompt:
numbers only) with n from 4 to 10 for 7 of every 8 prompts and from 140 to 160 for the 8th. Rows are not
shuffled, so every step's 8 prompts hold exactly one long one: 1 in 8 completions runs to about 600-660 tokens
(SmolLM2 writes a digit a token, then "," and " "), the rest to under 30 when the model does as asked. The
reward (`counting_reward`) is the length of the completion's correct prefix 1, 2, 3 ... (at most n) over the
larger of n and how many numbers it wrote: 1 for a complete count that stops, less for stopping early, running
past n or rambling. 8 prompts x 2 completions a step, grpo, lr 2e-5, at most 768 completion tokens at
temperature 0.7. A 768-token completion on a loaded 2-core machine outlasts the sampler's default 120 s
(`inference.request_timeout_s`), which would fail it as a timeout, so the workload allows 900 s.

Why this tail: a synchronous step waits for its longest completion, decoded a token at a time at a batch of 1
or 2 (0.1-0.2 s a token on 2 shared CPU cores), while training costs about the same per trained token whatever
the lengths; a partial step waits for one segment of `PARTIAL_TOKENS`. The tail's cost to a synchronous step,
and so what partial rollouts can save, grows with the tail's length over the segment's: several hundred tokens
against a 256-token segment. The 4-bit model rarely counts that far when asked (it stops early); the measured
tail is then the completions that ramble to the cap, which the report's completion tokens show.

Sides (`SIDES`; `DEFAULT_SIDES` run unless `--sides` names others: each holds a vLLM engine and a trainer, about
7 GB, and four do not fit in 24 GB), each a real `train` flow run (`flows.train.run_training`) in a subprocess of
its own against one embedded Prefect server, with the same seed, examples and trainer:

- `sync`: `max_off_policy_steps = 0`, every rollout of a step sampled to its end before training;
- `k=1`: `max_off_policy_steps = 1`, step n + 1 sampled beside step n's training, rollouts still whole;
- `partial`: `partial_rollout_tokens = PARTIAL_TOKENS` (256) with `max_off_policy_steps = 0`: each step samples
  one segment of its rollouts with the weights it trains from, then trains, nothing beside it. A long completion
  is at most 768 tokens, so it ends in 3 segments, one per step: its first tokens are 2 steps old when it trains,
  which `max_token_age = 2` allows, so no token is masked; a smaller N would mask the long rollouts' first tokens
  (or need a larger bound), a larger one makes each step wait longer;
- `partial k=1`: the same segments with `max_off_policy_steps = 1`, step n + 1's segment sampled beside step n's
  training with the weights of step n - 1. Its default token age bound is 2k = 2, and its tokens are a step older
  than on `partial` (a segment's tokens are 1 step old when sampled): a 3-segment rollout's first segment, 3 old,
  is masked.

The sides are interleaved step by step (bench/trl.py's `Side`: one side's step at a time, the order rotating),
so a shared machine's load hits all alike. Each run is `steps + 1` steps long and stopped before its last one,
so every measured step of the k = 1 sides samples the next one beside its training, as in the middle of a run;
no checkpoints (the same on every side), the weights exported every step for the sampler. Step 1 loads the
models (and with k = 1 samples ahead alone), so figures are over steps 2 .. steps:

- trained sampled tokens per second: the steps' `batch/rl_tokens` (sampled tokens that carry the rl loss, age-
  masked ones excluded) over the steps' wall time; steps per second;
- where the time goes: the median of each `time/*` key of metrics.json (sampling, wherever it ran; the stages;
  `wait_for_sampling`, training idle for the sampling beside it) and of the `partial/*` and `async/*` keys
  (segments per step, rollouts in flight, tokens carried over, token age), CPU seconds of the side's processes;
- the reward of every trained group (its mean over the group's completions), side by side by group: every side
  trains the same examples (the partial side later, when its long rollouts end), so the groups trained on all
  sides are compared one to one, long and short apart.

    python -m bench.partial [--steps 6]
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

STEPS = 6
PARTIAL_TOKENS = 256
WORKLOAD = {
    "model": "smollm2-135m", "dtype": "float32", "prompts_per_step": 8, "group_size": 2, "long_every": 8,
    "short_n": (4, 10), "long_n": (140, 160), "rows": 64, "max_completion_tokens": 768, "max_model_len": 896,
    "temperature": 0.7, "lr": 2e-5, "micro_batch_tokens": 1024, "request_timeout_s": 900.0,
    "system_prompt": "Reply with the numbers only, separated by commas.",
}
SIDES = {  # overrides of the workload's config
    "sync": {"max_off_policy_steps": 0},
    "k=1": {"max_off_policy_steps": 1},
    "partial": {"max_off_policy_steps": 0, "partial_rollout_tokens": PARTIAL_TOKENS, "max_token_age": 2},
    "partial k=1": {"max_off_policy_steps": 1, "partial_rollout_tokens": PARTIAL_TOKENS},
}
TARGET = ("partial", "sync")  # the pair the 1.5x is about; every other ratio is reported
# each side holds a vLLM engine and a trainer, about 7 GB: a fourth side does not fit in 24 GB beside them
DEFAULT_SIDES = ("sync", "partial", "partial k=1")
ENV = "dataset"
NUMBER = re.compile(r"\d+")


def long_tail_rows(workload: dict = WORKLOAD) -> list[dict]:
    """The dataset's rows: every `long_every`-th asks to count to a long n, the others to a short one."""
    rows, every = [], workload["long_every"]
    for i in range(workload["rows"]):
        if i % every == 0:
            low, high = workload["long_n"]
            n = low + (i * 7) % (high - low + 1)
        else:  # 10, 9, ... 4 in each run of 8 rows
            n = workload["short_n"][1] + 1 - i % every
        rows.append({"prompt": f"Count from 1 to {n}, separated by commas.",
                     "answer": ", ".join(str(x) for x in range(1, n + 1))})
    return rows


def counting_reward(completion: str, answer: str) -> float:
    """The correct prefix of the completion's numbers (1, 2, 3 ...) over the larger of n and the numbers written."""
    n = len(answer.split(","))
    numbers = [int(x) for x in NUMBER.findall(completion)]
    correct = next((i for i, x in enumerate(numbers[:n]) if x != i + 1), min(n, len(numbers)))
    return correct / max(n, len(numbers))


def side_config(side: str, data: str, storage: str, steps: int, workload: dict = WORKLOAD):
    from trace_rl.config import Config

    w = workload
    return Config(
        name=f"bench-partial-{side.replace('=', '').replace(' ', '-')}", steps=steps + 1, seed=0, storage=storage,
        model={"name": w["model"], "dtype": w["dtype"]},
        inference={"backend": "vllm", "max_model_len": w["max_model_len"], "request_timeout_s": w["request_timeout_s"]},
        sampling={"max_completion_tokens": w["max_completion_tokens"], "temperature": w["temperature"]},
        env=[{"id": ENV, "batch_size": w["prompts_per_step"], "group_size": w["group_size"],
              "args": {"path": data, "shuffle": False, "reward": "bench.partial:counting_reward",
                       "system_prompt": w["system_prompt"]}}],
        algorithms=["grpo"], async_=SIDES[side],
        trainer={"lr": w["lr"], "micro_batch_tokens": w["micro_batch_tokens"]},
        ckpt={"interval": steps + 100, "keep_weights_every": 0},
    )


class Stop(Exception):
    """Raised at the run's last step: the side has run its measured steps."""


def group_rewards(storage, step: int) -> dict[str, dict]:
    """Each trained group of the step: its mean reward, whether it counts to a long n, its mean completion tokens."""
    from trace_rl.tables import read_traces

    groups: dict[str, list] = {}
    for trace in read_traces(storage, step):
        groups.setdefault(trace.group_id, []).append(trace)
    return {group_id: {
        "reward": statistics.mean(t.reward for t in traces), "step": step,
        "long": len(traces[0].info["answer"].split(",")) >= WORKLOAD["long_n"][0],
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
    """Over the steps after the first: throughput, medians of the `time/*` and partial keys, rewards by group."""
    warm = rows[1:]
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
