"""One GPU: trace-rl's step on a Qwen2.5-0.5B-shaped model in bf16, and TRL's GRPOTrainer on the same work.

Workload (the defaults): the realistic fixture (`trace_rl.models.realistic`) at Qwen2.5-0.5B's full size
(`QWEN25_05B`: 24 layers, hidden 896, 151,936-token vocabulary, 494M parameters, random weights),
bf16, `reverse-text` prompts, 64 rollouts per step (8 prompts x 8) of up to 512 completion tokens at
temperature 1, grpo, lr 1e-6, `--steps` steps of which the first is warm-up. trace-rl samples with
its in-process vLLM engine colocated with the trainer on the same GPU (sleep mode: the engine sleeps
while the trainer runs) and trains in the same process; TRL runs `GRPOTrainer` with `use_vllm=True,
vllm_mode="colocate"`, the same prompts, group size, lengths and learning rate. Each side runs in its
own subprocess, one after the other, on the same GPU.

Reported per side, median of the warm steps: step seconds, split by stage (trace-rl: every pipeline
stage, the trainer's compute, checkpoint and weight export; TRL: generate-and-score vs the rest),
trainer tokens/s (prompt + completion tokens per second of forward + backward + optimizer step),
MFU = 6 N tokens / trainer seconds / peak bf16 FLOP/s of the device (N: the model's parameters,
the tied embedding once; peak from the device name, or `--peak-tflops`; on CPU a measured matmul),
sampler tokens/s (completion tokens per second of the sampling stage), and peak memory: the
trainer's own (torch's allocator in the trainer process) and the device's (all processes, the
engine's included, sampled every 50 ms; on CPU: peak RSS).

    python -m bench.gpu --out bench/RESULTS-gpu.md            # on a CUDA machine (make bench-gpu)
    python -m bench.gpu --size toy --rollouts 4 --completion-tokens 8 --steps 2 --sampler hf --trl hf   # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GROUP_SIZE = 8
ENV = "reverse-text"
LR = 1e-6
# dense bf16 tensor-core FLOP/s (no sparsity) by device name, most specific first
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("GH200", 989.4e12),
             ("A100", 312e12), ("L40S", 362.05e12), ("A10G", 70e12), ("L4", 121e12))
SIDE_TIMEOUT_S = 3600


def build_model(size: str, cache: str) -> str:
    from trace_rl.models import realistic

    architecture = realistic.QWEN25_05B if size == "full" else realistic.ARCHITECTURE
    return str(realistic.build_realistic_model(Path(cache), repo_id=f"trace-rl/bench-qwen2-{size}",
                                               architecture=architecture))


def parameter_count(model_dir: str) -> int:
    from trace_rl.inference.weights import local_tensor_shapes

    return sum(math.prod(shape) for shape in local_tensor_shapes(model_dir).values())


class MemoryWatch:
    """Peak device memory in use (all processes) while running, sampled every 50 ms; CUDA only."""

    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        import torch

        while not self._stop.wait(0.05):
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)

    def __enter__(self):
        if self.cuda:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()

    def take(self) -> float:
        """GB peak since the last take."""
        peak, self.peak = self.peak, 0
        return peak / 2**30


def peak_rss_gb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 2**20


def prompts(steps: int, per_step: int) -> list[list[dict]]:
    """The examples trace-rl's rollout loop draws at steps 1..`steps` (same seeds, same order)."""
    from trace_rl.envs.base import derive_seed
    from trace_rl.envs.lookup import load_env

    env = load_env(ENV, {})
    return [[e.data for e in env.examples(derive_seed(0, step, 0), per_step)] for step in range(1, steps + 1)]


def run_trace_rl(args, model_dir: str) -> list[dict]:
    import torch

    from bench.timers import pipeline_timers
    from trace_rl.config import Config
    from trace_rl.pipeline.session import session_for
    from trace_rl.pipeline.step import run_step
    from trace_rl.runs.start import prepare_run
    from trace_rl.tables import read_batch

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-gpu-") as tmp:
        config = Config(
            name="bench-gpu", steps=args.steps, seed=0, storage=tmp,
            model={"name": model_dir, "dtype": args.dtype},
            inference={"backend": args.sampler, "max_model_len": args.completion_tokens + 256,
                       "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": not cuda},
            sampling={"max_completion_tokens": args.completion_tokens, "temperature": 1.0},
            env=[{"id": ENV, "batch_size": args.rollouts // GROUP_SIZE, "group_size": GROUP_SIZE}],
            algorithms=["grpo"], ckpt={"interval": args.steps},  # one checkpoint, at the end
            trainer={"lr": LR, "micro_batch_tokens": args.micro_batch_tokens,
                     "activation_checkpointing": args.activation_checkpointing},
        )
        storage, _ = prepare_run(config, "new")
        session = session_for(config)
        rows = []
        with pipeline_timers() as timers, MemoryWatch() as memory:
            for step in range(1, args.steps + 1):
                timers.take()
                memory.take()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                started = time.perf_counter()
                result = run_step(session, step)
                wall = time.perf_counter() - started
                stages = timers.take()
                rows.append({
                    "step_seconds": wall, "stages": stages, "trainer_seconds": stages["trainer/compute"],
                    "sample_seconds": stages["sample_rollouts"], "tokens": result["train"]["metrics"]["tokens"],
                    "completion_tokens": int(sum(s.sampled.sum() for s in read_batch(storage, step))),
                    "trainer_peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                    "device_peak_gb": memory.take() if cuda else None,
                })
        from flows import quiet

        quiet.stop_engines()
    return rows


def run_trl(args, model_dir: str) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trace_rl.envs.similarity import similarity

    cuda = torch.cuda.is_available()
    per_step = args.rollouts // GROUP_SIZE
    data = [{"prompt": [{"role": "user", "content": f"reverse: {e['text']}"}], "answer": e["answer"]}
            for examples in prompts(args.steps, per_step) for e in examples]

    def reward(completions, answer, **kwargs) -> list[float]:
        return [similarity(c[0]["content"].strip(), a) for c, a in zip(completions, answer)]

    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-gpu-trl-") as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=not cuda, bf16=cuda and args.dtype == "bfloat16", report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, max_steps=args.steps,
            per_device_train_batch_size=args.rollouts, gradient_accumulation_steps=1, num_generations=GROUP_SIZE,
            max_completion_length=args.completion_tokens, temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR,
            lr_scheduler_type="constant", warmup_steps=0, beta=0.0, num_iterations=1, loss_type="dapo",
            scale_rewards="none", shuffle_dataset=False, gradient_checkpointing=args.activation_checkpointing,
            use_vllm=args.trl == "vllm", vllm_mode="colocate", vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        )
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(data),
                              processing_class=AutoTokenizer.from_pretrained(model_dir))
        generation: list[tuple[float, int, int]] = []
        generate_and_score = trainer._generate_and_score_completions

        def timed_generate_and_score(inputs):
            started = time.perf_counter()
            out = generate_and_score(inputs)
            completion = int(out["completion_mask"].sum())
            generation.append((time.perf_counter() - started, int(out["prompt_mask"].sum()) + completion, completion))
            return out

        trainer._generate_and_score_completions = timed_generate_and_score
        clock: list[float] = []
        memory = MemoryWatch()
        device_peaks: list[float | None] = []

        class StepClock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                memory.take()
                self.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                clock.append(time.perf_counter() - self.started)
                device_peaks.append(memory.take() if cuda else None)

        trainer.add_callback(StepClock())
        with memory:
            trainer.train()
    return [{"step_seconds": wall, "stages": {"generate_and_score": gen, "train": wall - gen},
             "trainer_seconds": wall - gen, "sample_seconds": gen, "tokens": tokens, "completion_tokens": completion,
             "trainer_peak_gb": None, "device_peak_gb": peak}
            for wall, (gen, tokens, completion), peak in zip(clock, generation, device_peaks)]


def peak_flops(override_tflops: float | None) -> tuple[float, str]:
    """The device's peak bf16 FLOP/s and where the figure comes from."""
    import torch

    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, flops in PEAK_BF16:
            if key in name:
                return flops, f"{name} datasheet, dense bf16"
        raise SystemExit(f"no peak bf16 FLOP/s known for {name!r}; pass --peak-tflops")
    from bench.trainer import matmul_flops_per_s

    return matmul_flops_per_s(torch.device("cpu"), torch.float32), "measured float32 matmul (CPU)"


def summarize(rows: list[dict], parameters: int, flops: float) -> dict:
    """Medians of the warm steps (all steps when there is only one)."""
    warm = rows[1:] or rows
    median = lambda values: statistics.median(list(values))  # noqa: E731
    trainer_tokens_per_s = median(r["tokens"] / r["trainer_seconds"] for r in warm)
    return {
        "steps_measured": len(warm),
        "step_seconds": median(r["step_seconds"] for r in warm),
        "stages": {name: median(r["stages"].get(name, 0.0) for r in warm) for name in warm[0]["stages"]},
        "trainer_tokens_per_s": trainer_tokens_per_s,
        "mfu": 6 * parameters * trainer_tokens_per_s / flops,
        "sampler_tokens_per_s": median(r["completion_tokens"] / r["sample_seconds"] for r in warm),
        "tokens_per_step": median(r["tokens"] for r in warm),
        "completion_tokens_per_step": median(r["completion_tokens"] for r in warm),
        "trainer_peak_gb": max((r["trainer_peak_gb"] or 0.0) for r in rows) or None,
        "device_peak_gb": max((r["device_peak_gb"] or 0.0) for r in rows) or None,
    }


def side_main(args) -> None:
    model_dir = build_model(args.size, args.cache)
    rows = run_trace_rl(args, model_dir) if args.side == "trace-rl" else run_trl(args, model_dir)
    with open(args.result, "w") as f:
        json.dump({"rows": rows, "peak_rss_gb": peak_rss_gb()}, f)


def run_side(side: str, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-gpu-") as tmp:
        result = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "bench.gpu", *argv, "--side", side, "--result", result]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=SIDE_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish within {SIDE_TIMEOUT_S}s"}
        if done.returncode != 0 or not os.path.exists(result):
            lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            errors = [line for line in lines if "Error" in line or "error" in line]
            return {"error": (errors or lines or ["no output"])[-1][:500]}
        with open(result) as f:
            return json.load(f)


def report(results: dict, args, parameters: int, flops_source: str, device: str) -> str:
    lines = [f"# GPU benchmark: {device}", "",
             f"`python -m bench.gpu {' '.join(args.argv)}`: {args.size} model ({parameters / 1e6:,.0f}M parameters), "
             f"{args.dtype}, {args.rollouts} rollouts x {args.completion_tokens} completion tokens, "
             f"{args.steps} steps (the first is warm-up), trace-rl sampler {args.sampler}, TRL {args.trl}; "
             f"peak FLOP/s: {flops_source}.", "",
             "| | step s | trainer tokens/s | MFU | sampler tokens/s | trainer peak GB | device peak GB | peak RSS GB |",
             "|---|---|---|---|---|---|---|---|"]
    for side, result in results.items():
        if "error" in result:
            lines.append(f"| {side} | failed: {result['error']} | | | | | | |")
            continue
        s = result["summary"]
        gb = lambda value: f"{value:.1f}" if value else "-"  # noqa: E731
        lines.append(f"| {side} | {s['step_seconds']:.2f} | {s['trainer_tokens_per_s']:,.0f} | {s['mfu']:.1%} | "
                     f"{s['sampler_tokens_per_s']:,.0f} | {gb(s['trainer_peak_gb'])} | {gb(s['device_peak_gb'])} | "
                     f"{gb(result['peak_rss_gb'])} |")
    ours, theirs = results.get("trace-rl", {}), results.get("trl", {})
    if "summary" in ours and "summary" in theirs:
        lines += ["", f"trace-rl step time / TRL step time: "
                      f"{ours['summary']['step_seconds'] / theirs['summary']['step_seconds']:.2f} (target <= 0.8)"]
    for side, result in results.items():
        if "summary" in result:
            stages = ", ".join(f"{name} {seconds:.2f}" for name, seconds in result["summary"]["stages"].items())
            lines += ["", f"{side} stage seconds (median): {stages}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("full", "toy"), default="full")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rollouts", type=int, default=64, help="per step, a multiple of 8 (8 per prompt)")
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--sampler", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--trl", choices=("vllm", "hf", "off"), default="vllm")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak bf16 TFLOP/s, if not known by name")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "trace-rl-bench-models"))
    parser.add_argument("--out", help="write the markdown report here (e.g. bench/RESULTS-gpu.md)")
    parser.add_argument("--side", choices=("trace-rl", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.rollouts % GROUP_SIZE:
        parser.error(f"--rollouts must be a multiple of {GROUP_SIZE} (the group size)")
    if args.side:
        side_main(args)
        return {}
    import torch

    if args.size == "full" and not torch.cuda.is_available():
        parser.error("--size full needs a CUDA GPU; on CPU use --size toy with small --rollouts/--completion-tokens")
    args.argv = argv
    model_dir = build_model(args.size, args.cache)
    parameters = parameter_count(model_dir)
    flops, flops_source = peak_flops(args.peak_tflops)
    sides = ["trace-rl"] + (["trl"] if args.trl != "off" else [])
    results = {}
    for side in sides:
        result = run_side(side, argv)
        if "rows" in result:
            result["summary"] = summarize(result["rows"], parameters, flops)
        results[side] = result
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    text = report(results, args, parameters, flops_source, device)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return {"device": device, "parameters": parameters, "peak_flops": flops, "sides": results}


if __name__ == "__main__":
    main()
