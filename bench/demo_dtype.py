"""`make demo`'s step in `model.dtype = "auto"` against `"float32"`, stepped in turn: `python -m bench.demo_dtype`.

Library runs of configs/math.toml (`bench.step.library_stepper`: `trace_rl.pipeline.step.run_step`, no
Prefect) in one process, one with `model.dtype = "auto"`, one with `"float32"` (and one per dtype `--dtypes` adds,
e.g. `bfloat16` on both sides where auto keeps the sampler in float32), same seed and data. Step `s` of every
run back to back, the order reversed on even steps (auto first on odd steps), so the load of a shared machine
hits all alike. Step 1 loads the models and builds the trainers: only steps 2.. count. Per step and run: the wall
time, sampling (`sample_rollouts`), the trainer's compute (`Trainer.optimizer_step`), the rest (algorithms,
Parquet, checkpoint, weight export and broadcast), and the sampler-trainer gap the step's importance ratio saw
(`mismatch/mean_abs_logprob_diff`, the trainer's metric: mean |Δlogprob| over the scored tokens).

The trainer's bfloat16 floor is its step's matmul FLOPs at this machine's bfloat16 matmul rate
(`bench.trainer.matmul_flops_per_s`, a 1024^3 matmul, measured before and after the steps, the faster kept):

    FLOPs = 6 x positions x (parameters - embedding) + 8 x scored positions x vocabulary x hidden

`positions` are the packed rows' tokens after prefix sharing (`tokens`), `scored positions` the output layer's
(`output_positions`); the output layer's 8 = its forward, its forward again in the backward (chunked), and the
backward's two GEMMs. Attention's FLOPs (under 2% at the demo's lengths) are left out, so the floor is low by that.

    flock /tmp/trace-rl-heavy.lock .venv/bin/python -m bench.demo_dtype --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

DEMO_CONFIG = "configs/math.toml"
DTYPES = ("auto", "float32")


def demo_config(storage: str, dtype: str, steps: int, seed: int = 0):
    from trace_rl.runs.loading import load_config

    return load_config(DEMO_CONFIG, [f"model.dtype={json.dumps(dtype)}", f"name={json.dumps('demo-' + dtype)}",
                                     f"storage={json.dumps(storage)}", f"steps={steps}", f"seed={seed}"])


def demo_row(row: dict) -> dict:
    """A `bench.step.library_stepper` row as this bench records it: wall, sampling and trainer seconds, the train
    stage's, and the trainer's metrics."""
    timed = row["timed"]
    return {"step": row["step"], "wall": row["wall"], "sampling": timed.get("sample_rollouts", 0.0),
            "trainer": timed.get("trainer/compute", 0.0), "train_stage": timed.get("train", 0.0),
            "metrics": row["train_metrics"], "load": os.getloadavg()[0], "timed": timed}


def demo_model(config):
    """The demo's model with no weights (meta tensors): its shapes and parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trace_rl.models.hub import resolve_model_path

    model_config = AutoConfig.from_pretrained(resolve_model_path(config.model.name))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def trainer_flops(model, metrics: dict) -> float:
    """The trainer step's matmul FLOPs (the module docstring's formula)."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    body = params - c.vocab_size * c.hidden_size
    return 6 * metrics["tokens"] * body + 8 * metrics["output_positions"] * c.vocab_size * c.hidden_size


def summary(rows: list[dict], model, rate: float) -> dict:
    warm = rows[1:]
    median = {key: statistics.median(r[key] for r in warm) for key in ("wall", "sampling", "trainer")}
    floor = statistics.median(trainer_flops(model, r["metrics"]) / rate for r in warm)
    mismatch = statistics.median(r["metrics"]["mismatch/mean_abs_logprob_diff"] for r in warm)
    return {**median, "rest": median["wall"] - median["sampling"] - median["trainer"], "trainer_floor": floor,
            "trainer_over_floor": median["trainer"] / floor, "mismatch": mismatch}


def run(steps: int, dtypes: tuple[str, ...] = DTYPES, seed: int = 0) -> dict:
    import torch

    from bench.step import library_stepper
    from bench.timers import pipeline_timers
    from bench.trainer import matmul_flops_per_s
    from trace_rl.models.dtype import choose_dtype, cpu_flags

    cpu = torch.device("cpu")
    rates = [matmul_flops_per_s(cpu, torch.bfloat16)]
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-demo-dtype-") as home, pipeline_timers() as timers:
        configs = {dtype: demo_config(os.path.join(home, "runs"), dtype, steps, seed) for dtype in dtypes}
        model = demo_model(configs["float32"])
        steppers = {dtype: library_stepper(configs[dtype], timers) for dtype in dtypes}
        rows: dict[str, list[dict]] = {dtype: [] for dtype in dtypes}
        for step in range(1, steps + 1):
            for dtype in (dtypes if step % 2 else dtypes[::-1]):
                rows[dtype].append(demo_row(steppers[dtype](step)))
                row = rows[dtype][-1]
                print(json.dumps({"dtype": dtype, **{k: v for k, v in row.items() if k != "metrics"},
                                  **{k: row["metrics"][k] for k in ("tokens", "output_positions",
                                                                    "mismatch/mean_abs_logprob_diff")}}),
                      flush=True)
        rates.append(matmul_flops_per_s(cpu, torch.bfloat16))
        rate = max(rates)
        result = {dtype: summary(rows[dtype], model, rate) for dtype in dtypes}
    flags = cpu_flags()
    return {
        "steps": steps, "seed": seed, "bf16_matmul_gflops": [r / 1e9 for r in rates],
        "loads": [r["load"] for r in rows["auto"]],
        "auto_is": {side: choose_dtype(False, flags, side)[0] for side in ("trainer", "sampler")},
        "dtypes": list(dtypes), "speedup": result["float32"]["wall"] / result["auto"]["wall"], **result, "rows": rows,
    }


def report(result: dict) -> str:
    lines = [f"auto = trainer {result['auto_is']['trainer']}, sampler {result['auto_is']['sampler']}; bf16 matmul "
             f"{', '.join(f'{r:.0f}' for r in result['bf16_matmul_gflops'])} GFLOP/s; load "
             f"{', '.join(f'{x:.1f}' for x in result['loads'])}",
             "| dtype | step s | sampling s | trainer s | rest s | trainer floor s | trainer / floor | mismatch |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype in result["dtypes"]:
        r = result[dtype]
        lines.append(f"| {dtype} | {r['wall']:.2f} | {r['sampling']:.2f} | {r['trainer']:.2f} | {r['rest']:.2f} | "
                     f"{r['trainer_floor']:.2f} | {r['trainer_over_floor']:.1f} | {r['mismatch']:.1e} |")
    lines += [f"{dtype} step {result['float32']['wall'] / result[dtype]['wall']:.2f}x float32's"
              for dtype in result["dtypes"] if dtype != "float32"]
    lines.append(f"(medians of steps 2-{result['steps']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per dtype (the first is a warm-up)")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="model.dtype of each run, comma-separated; auto and float32 always run (e.g. "
                             "auto,bfloat16,float32 to step bfloat16 on both sides beside auto's choice)")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (the demo's is 0): another seed samples "
                                                                "other completions, of other lengths")
    args = parser.parse_args(argv)
    dtypes = tuple(dict.fromkeys(["auto", *args.dtypes.split(","), "float32"]))
    result = run(args.steps, dtypes, args.seed)
    print(report(result))
    return result


if __name__ == "__main__":
    main()
