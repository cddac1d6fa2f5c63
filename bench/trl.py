"""trace-rl and TRL's `GRPOTrainer` side by side on the same work.

The work is bench/step.py's reference workload: the tiny model (`trace_rl.tiny.build_tiny(0)`),
`reverse-text` prompts (the very examples trace-rl draws at each step, handed to TRL in the
same order, unshuffled), 8 prompts x 8 completions per step, at most 32 completion tokens at
temperature 1 (top-k and top-p off), lr 1e-3 constant, AdamW (betas 0.9/0.999, no weight
decay), grad-norm clip 1, one optimizer step per step, no KL term, advantages r - mean_group(r)
(TRL: `scale_rewards="none"`), a loss normalized by the batch's completion tokens (TRL:
`loss_type="dapo"`). Both sample with transformers generate (trace-rl: `inference.backend =
"hf"`); trace-rl also runs with its in-process vLLM engine. TRL's vLLM path is tried too
(`use_vllm=True`, colocate): TRL 1.x supports vLLM 0.22-0.31 on CUDA; what happens here is
reported as is.

Each side runs in its own subprocess, so its peak RSS is its own. Reported per side, best of
the steps after the first (warm-up; medians too): step seconds (everything: sampling, advantages,
training, and for trace-rl also the Parquet hand-offs, the checkpoint, the weight export
and the broadcast), trainer seconds and trainer tokens/s (non-pad prompt + completion tokens
per second of forward + backward + optimizer step: trace-rl's `Trainer.train_step`, TRL's
step minus its generate-and-score phase), peak RSS, and the mean reward per step.

    python -m bench.trl
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
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


def run_trace_rl(steps: int, backend: str) -> dict:
    from bench.timers import pipeline_timers
    from trace_rl.run import prepare_run
    from trace_rl.session import session_for
    from trace_rl.step import run_step

    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-trl-") as tmp:
        config = reference_config(os.path.join(tmp, "runs"), f"bench-{backend}", steps)
        config.inference.backend = backend
        prepare_run(config, "new")
        session = session_for(config)
        rows = []
        with pipeline_timers() as timers:
            for step in range(1, steps + 1):
                timers.take()
                started = time.perf_counter()
                result = run_step(session, step)
                wall = time.perf_counter() - started
                timed = timers.take()
                rows.append({
                    "step_seconds": wall, "trainer_seconds": timed["trainer/compute"],
                    "sample_seconds": timed["sample_rollouts"], "tokens": result["train"]["metrics"]["tokens"],
                    "reward": result["rollouts"]["metrics"][f"rollouts/{REFERENCE['env']}/reward_mean"],
                })
        if backend == "vllm":
            from trace_rl.inference.vllm_engine import shutdown_engines

            shutdown_engines()
    return {"rows": rows}


def run_trl(steps: int, use_vllm: bool) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trace_rl.envs.similarity import similarity
    from trace_rl.tiny import build_tiny

    model_path = str(build_tiny(0))
    prompt = "reverse: {text}"  # reverse-text's default user message
    data = [{"prompt": [{"role": "user", "content": prompt.format(text=e["text"])}], "answer": e["answer"]}
            for examples in step_examples(steps) for e in examples]

    def reward(completions, answer, **kwargs) -> list[float]:
        return [similarity(c[0]["content"].strip(), a) for c, a in zip(completions, answer)]

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
        step_seconds: list[float] = []

        class StepClock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                self.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                step_seconds.append(time.perf_counter() - self.started)

        trainer.add_callback(StepClock())
        trainer.train()
        rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return {"rows": [
        {"step_seconds": wall, "trainer_seconds": wall - gen, "sample_seconds": gen, "tokens": tokens, "reward": r}
        for wall, (gen, tokens), r in zip(step_seconds, generation, rewards)
    ]}


def side_main(side: str, steps: int, out: str) -> None:
    started = time.perf_counter()
    if side.startswith("trace-rl"):
        result = run_trace_rl(steps, side.removeprefix("trace-rl-"))
    else:
        result = run_trl(steps, use_vllm=side == "trl-vllm")
    result.update(side=side, total_seconds=time.perf_counter() - started, peak_rss_mb=peak_rss_mb(),
                  load_average=os.getloadavg()[0])
    with open(out, "w") as f:
        json.dump(result, f)


def summarize(result: dict) -> dict:
    """Best of the warm steps (a shared machine only ever slows a step down), medians alongside."""
    warm = result["rows"][1:]
    return {
        "step_seconds": min(r["step_seconds"] for r in warm),
        "median_step_seconds": statistics.median(r["step_seconds"] for r in warm),
        "sample_seconds": min(r["sample_seconds"] for r in warm),
        "trainer_seconds": min(r["trainer_seconds"] for r in warm),
        "trainer_tokens_per_s": max(r["tokens"] / r["trainer_seconds"] for r in warm),
        "median_trainer_tokens_per_s": statistics.median(r["tokens"] / r["trainer_seconds"] for r in warm),
        "tokens_per_step": sum(r["tokens"] for r in warm) / len(warm),
        "peak_rss_mb": result["peak_rss_mb"],
        "rewards": [r["reward"] for r in result["rows"]],
        "final_reward": result["rows"][-1]["reward"],
        "load_average": result["load_average"],
    }


def run_side(side: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-trl-") as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "bench.trl", "--side", side, "--steps", str(steps), "--out", out]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=SIDE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"side": side, "error": f"did not finish within {SIDE_TIMEOUT_S}s"}
        if done.returncode != 0 or not os.path.exists(out):
            lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            errors = [line for line in lines if "Error" in line or "error" in line]
            return {"side": side, "error": (errors or lines or ["no output"])[-1][:400]}
        with open(out) as f:
            return {"side": side, **summarize(json.load(f))}


def run(steps: int = STEPS, sides: tuple[str, ...] = SIDES) -> dict:
    results = {side: run_side(side, steps) for side in sides}
    ratios = {}
    for backend in ("hf", "vllm"):
        ours, theirs = results.get(f"trace-rl-{backend}", {}), results.get(f"trl-{backend}", {})
        if "error" in ours or "error" in theirs or not ours or not theirs:
            continue
        ratios[backend] = {
            "step_speedup": theirs["step_seconds"] / ours["step_seconds"],
            "trainer_tokens_per_s": ours["trainer_tokens_per_s"] / theirs["trainer_tokens_per_s"],
            "peak_rss": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
        }
    ours, theirs = results.get("trace-rl-vllm", {}), results.get("trl-hf", {})
    if ours and theirs and "error" not in ours and "error" not in theirs:
        ratios["trace-rl vllm vs trl hf"] = {
            "step_speedup": theirs["step_seconds"] / ours["step_seconds"],
            "trainer_tokens_per_s": ours["trainer_tokens_per_s"] / theirs["trainer_tokens_per_s"],
            "peak_rss": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
        }
    return {"workload": REFERENCE, "steps": steps, "sides": results, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES, help="run one side in this process (internal)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.side:
        side_main(args.side, args.steps, args.out)
        return
    print(json.dumps(run(args.steps), indent=2))


if __name__ == "__main__":
    main()
