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

Sides (`SIDES`; `DEFAULT_SIDES` run unless `--sides` names others), each a real `train` flow run
(`flows.train.run_training`) in a subprocess of its own against one embedded Prefect server, with the same seed,
examples and trainer:

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
so a shared machine's load hits all alike.

How they share the machine: each side holds a vLLM engine and a trainer, about `SIDE_GB` (7 GB), and the
bench's processes together must stay under `MEMORY_BUDGET` (75%) of the machine's memory. As many sides as fit
in it are resident at once (`resident_sides`: 2 on a 24 GB machine); when the sides asked for do not all fit,
they run in rounds (`rounds`), each round interleaved step by step on its own and each holding `sync` beside as
many others as fit, so every ratio to sync is taken between sides that ran side by side. While sides run, a
watcher (`Watch`) sums the memory of every process of the bench (PSS: a page shared between processes counts
once), reports its peak, and fails the benchmark at once, killing every side, if one dies (naming the side and
how it ended: the kernel's OOM killer sends SIGKILL) or the sum passes the budget. Each side also gives the
memory its step freed back to the system after the step (`bench.trl.release_free_memory`). Each run is `steps + 1` steps long and stopped before its last one,
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
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.trl import END, ROW, Side, interleave, release_free_memory, report, tree_cpu_seconds, wait_for_turn

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
REFERENCE = "sync"  # the side every other is compared with, in every round
DEFAULT_SIDES = ("sync", "partial", "partial k=1")
# a side's peak, its trainer process with its vLLM engine: three sides and the Prefect server held 22 GB on
# November 27 (the k=1 side then OOM-killed on a 23 GB machine)
SIDE_GB = 7.0
BASE_GB = 1.0  # this process and the Prefect server
MEMORY_BUDGET = 0.75  # of the machine's memory, for every process of the bench together
LIVENESS_S = 0.25  # how often the watcher checks that every side lives
MEMORY_S = 1.0  # how often it sums their memory
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


def side_main(side: str, steps: int, data: str, storage: str, workload: dict = WORKLOAD) -> None:
    import flows.train
    from trace_rl.inference.vllm_engine import shutdown_engines
    from trace_rl.storage import RunStorage

    config = side_config(side, data, storage, steps, workload)
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
        release_free_memory()
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


def summarize(rows: list[dict], warmup_steps: int = WORKLOAD["warmup_steps"]) -> dict:
    """Over the steps after the warm-up: throughput, medians of the `time/*` and partial keys, rewards by group."""
    warm = rows[warmup_steps:]
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


class BenchmarkFailed(Exception):
    """A side died or failed, or memory passed the budget: the benchmark stops at once (every side killed)."""


class Refused(Exception):
    """The sides asked for cannot run on this machine (a one-line error, exit 2)."""


def exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (" (as the kernel's OOM killer kills)" if name == "SIGKILL" else "")
    return f"exit code {code}"


class PartialSide(Side):
    watch: Watch | None = None
    warmup_steps = WORKLOAD["warmup_steps"]

    def step(self, timeout_s: float) -> None:
        try:
            super().step(timeout_s)
        except BrokenPipeError:  # it died while it waited for its turn
            self.error = self.error or "exited"
        if self.error is not None:
            raise BenchmarkFailed(self.watch and self.watch.failure or self.failure())

    def failure(self) -> str:
        """How the side ended (or why it is failed, when it still runs) and its last log line."""
        try:
            self.process.wait(5)  # its output ended: its exit code follows
            how = exit_reason(self.process.returncode)
        except subprocess.TimeoutExpired:
            how = self.error
        return f"the side {self.name!r} died: {how}; its last log line: {self.last_log_line()}"

    def summarize(self, end: dict) -> dict:
        return summarize(self.rows, self.warmup_steps)


class Watch:
    """While sides run: the memory of the bench's processes, summed (PSS) and its peak; and whether every side
    lives. A side that ends before it is told to, or memory past `budget` bytes, fails the benchmark at once:
    `failure` says why, every side is killed, and the step waiting for one returns."""

    def __init__(self, sides: list[PartialSide], others: list[int], budget: int):
        self.sides, self.others, self.budget = sides, others, budget
        self.peak = 0
        self.failure: str | None = None
        for side in sides:
            side.watch = self
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-watch")
        self._thread.start()

    def memory(self) -> int:
        from trace_rl.machine.processes import descendants, memory

        roots = [os.getpid(), *self.others, *(side.process.pid for side in self.sides)]
        pids = {os.getpid()} | {pid for root in roots[1:] for pid in (root, *descendants(root))}
        return sum(memory(pid) for pid in pids)

    def _run(self) -> None:
        from trace_rl.machine.processes import machine_memory

        next_sum = 0.0
        while not self._done.wait(LIVENESS_S):
            for side in self.sides:
                if side.process.poll() not in (None, 0):
                    side.reader.join(1)  # what it wrote before it ended: an exit after its END line is no failure
                    if not side.ended:
                        return self.fail(side.failure())
            if time.monotonic() >= next_sum:
                next_sum = time.monotonic() + MEMORY_S
                held = self.memory()
                self.peak = max(self.peak, held)
                if held > self.budget:
                    return self.fail(f"its processes hold {held / 2**30:.1f} GB, over {MEMORY_BUDGET:.0%} of this "
                                     f"machine's {machine_memory() / 2**30:.1f} GB: a side holds more than SIDE_GB "
                                     f"({SIDE_GB:g}); raise it in bench/partial.py so that fewer sides run at once")

    def fail(self, why: str) -> None:
        self.failure = why
        for side in self.sides:
            side.error = side.error or why
            side.kill()
            side.lines.put(None)  # wakes the coordinator if it waits for this side

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def resident_sides() -> int:
    """How many sides fit in the memory budget at once, beside this process and the Prefect server."""
    from trace_rl.machine.processes import machine_memory

    return int((MEMORY_BUDGET * machine_memory() / 2**30 - BASE_GB) // SIDE_GB)


def rounds(sides: tuple[str, ...], resident: int) -> list[tuple[str, ...]]:
    """The sides in rounds of at most `resident`: all in one when they fit, else `REFERENCE` in every round beside
    as many others as fit, so every ratio to it is taken between sides that ran side by side."""
    if len(sides) <= resident:
        return [sides]
    if resident < 2 or REFERENCE not in sides:
        raise Refused(f"--sides {', '.join(map(repr, sides))}: {resident} side(s) of about {SIDE_GB:g} GB fit in "
                      f"{MEMORY_BUDGET:.0%} of this machine's memory; name at most {max(resident, 1)}, or "
                      f"{REFERENCE!r} among them to run in rounds")
    others = [side for side in sides if side != REFERENCE]
    return [(REFERENCE, *others[i:i + resident - 1]) for i in range(0, len(others), resident - 1)]


def run_round(sides: tuple[str, ...], steps: int, home: str, data: str, workload: dict = WORKLOAD,
              others: tuple[int, ...] = ()) -> tuple[dict[str, dict], int]:
    """The sides interleaved step by step, watched (`Watch`; `others`: more pids whose memory counts, e.g. the
    Prefect server's); their summaries and the peak memory of the bench's processes. Raises `BenchmarkFailed`."""
    from trace_rl.machine.processes import machine_memory

    os.makedirs(home, exist_ok=True)
    running = [PartialSide(side, steps, home, command=[
        sys.executable, "-m", "bench.partial", "--side", side, "--steps", str(steps), "--data", data,
        "--storage", os.path.join(home, "runs"), "--workload", json.dumps(workload)]) for side in sides]
    for side in running:
        side.warmup_steps = workload["warmup_steps"]
    watch = Watch(running, list(others), int(MEMORY_BUDGET * machine_memory()))
    try:
        results = interleave(running, steps)
    finally:
        watch.stop()
        for side in running:  # after a failure: nothing of any side is left
            side.kill()
    if watch.failure:
        raise BenchmarkFailed(watch.failure)
    return results, watch.peak


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


PAIRS = (TARGET, ("partial k=1", "sync"), ("k=1", "sync"), ("partial", "k=1"))


def run(steps: int = STEPS, sides: tuple[str, ...] = DEFAULT_SIDES, workload: dict = WORKLOAD) -> dict:
    from bench.step import use_private_prefect
    from trace_rl.machine.processes import machine_memory

    plan = rounds(sides, resident_sides())
    load_before = os.getloadavg()[0]
    results, ratios, peak = {}, {}, 0
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-partial-") as home:
        use_private_prefect(home)
        from flows import prefect_server

        server = prefect_server.start()
        os.environ["PREFECT_API_URL"] = server["api_url"]
        data = os.path.join(home, "long_tail.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in long_tail_rows(workload))
        try:
            for number, names in enumerate(plan, 1):
                done, round_peak = run_round(names, steps, os.path.join(home, f"round-{number}"), data, workload,
                                             others=(server["pid"],))
                peak = max(peak, round_peak)
                ratios.update({f"{ours} / {theirs}": {
                    "trained_tokens_per_s": done[ours]["trained_tokens_per_s"] / done[theirs]["trained_tokens_per_s"],
                    "steps_per_s": done[ours]["steps_per_s"] / done[theirs]["steps_per_s"]}
                    for ours, theirs in PAIRS if ours in done and theirs in done})
                results.update({name if name not in results else f"{name}, round {number}": summary
                                for name, summary in done.items()})
        finally:
            prefect_server.stop()
    loads = [x for s in results.values() for x in s["loads"]]
    machine = machine_memory()
    return {"workload": workload, "side_configs": {side: SIDES[side] for side in sides}, "steps": steps,
            "sides": results, "rounds": [list(names) for names in plan],
            "memory": {"peak_gb": peak / 2**30, "machine_gb": machine / 2**30, "peak_fraction": peak / machine,
                       "budget_fraction": MEMORY_BUDGET},
            "ratios": ratios, "groups": compare_groups(results) if REFERENCE in results and len(results) > 1 else None,
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
    parser.add_argument("--workload", type=json.loads, default=WORKLOAD, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side_main(args.side, args.steps, args.data, args.storage, args.workload)
        return
    try:
        result = run(args.steps, tuple(args.sides))
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except BenchmarkFailed as exc:
        print(f"error: bench.partial failed: {exc}", file=sys.stderr)
        sys.exit(1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "groups"}, indent=1, default=str))


if __name__ == "__main__":
    main()
