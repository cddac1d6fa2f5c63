"""Sampling overlapped with training (`[async] max_off_policy_steps`): sync vs k = 1 vs k = 2, in one process.

Two workloads, each `configs/demo.toml` with overrides (`WORKLOADS`): `demo` as shipped (vLLM
sampler), and `balanced`, where sampling and training take about the same time. Every (workload,
k) is a real `train` flow run (`flows.train.run_training`) against an embedded Prefect server on a
free loopback port, `STEPS` steps, the same seed. Per run, from each step's `metrics.json`:

- step time: the wall time of the step's `train_step` subflow, median over the steady steps 2 .. STEPS - 2 (step 1 loads models and,
  with k >= 1, samples ahead before anything overlaps; the last k steps have nothing to sample
  beside their training); steps/s is its inverse; speedup is the sync step time over it;
- the bound: the stages before `train` (algorithms, validate, aggregate, write_batch) plus
  max(time/sample_rollouts of the step sampled beside, time/train) plus the step's orchestration,
  i.e. what a perfect overlap would take; the ratio of the step time to it (target <= 1.10);
- orchestration per step: `time/step` minus the stage clocks of the subflow (the flow's task-run
  clocks with k = 0; with k >= 1 sampling runs beside `train`, so minus the stages before
  `train`, `train` and the wait); this is Prefect + storage outside the stages (bench/step.py
  splits it further);
- in-run speedup: the same run's stage times one after the other (before + sampling + train +
  orchestration) over its step time: what the overlap saved, immune to load changing between runs;
- reward after a fixed wall-clock budget: the fastest run's total time of its steps 2..STEPS; each
  run's mean reward over its last 3 steps finished within that budget, counted from step 2
  (learning must not collapse).

    python -m bench.overlap [--steps N] [--workloads demo balanced]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.step import use_private_prefect

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
KS = (0, 1, 2)
REWARD_KEY = "rollouts/reverse-text/reward_mean"
BEFORE_TRAIN = ("algorithm/grpo", "validate_dimensions", "aggregate_channels", "write_batch")
WORKLOADS = {  # overrides of configs/demo.toml
    "demo": [],
    # the transformers sampler: sampling takes about as long as training here
    "balanced": ["inference.backend=hf"],
}
TARGET_SPEEDUP = 1.5
TARGET_BOUND = 1.10


def steady(rows: list[dict], steps: int) -> list[dict]:
    return [r for r in rows if 2 <= r["step"] <= steps - max(KS)]


def summarize(rows: list[dict], steps: int, k: int) -> dict:
    """Medians over the steady steps; the sampling beside step n is that of step n + k (its own `time/...`)."""
    by_step = {r["step"]: r for r in rows}
    warm = steady(rows, steps)
    step_time = statistics.median(r["time/step"] for r in warm)
    before = statistics.median(sum(r.get(f"time/{s}", 0.0) for s in BEFORE_TRAIN) for r in warm)
    train = statistics.median(r["time/train"] for r in warm)
    sample = statistics.median(by_step[r["step"] + k]["time/sample_rollouts"] for r in warm) if k else \
        statistics.median(r["time/sample_rollouts"] for r in warm)
    clocks = [sum(r.get(f"time/{s}", 0.0) for s in (*BEFORE_TRAIN, "train", "wait_for_sampling", "broadcast_weights"))
              + (r["time/sample_rollouts"] if k == 0 else 0.0) for r in warm]
    orchestration = statistics.median(r["time/step"] - c for r, c in zip(warm, clocks))
    bound = before + (max(sample, train) if k else sample + train) + orchestration
    sequential = before + sample + train + orchestration  # the same stage times, one after the other
    return {"in_run_speedup": sequential / step_time, "step_seconds": step_time, "steps_per_s": 1 / step_time, "sample_seconds": sample,
            "train_seconds": train, "before_train_seconds": before, "orchestration_seconds": orchestration,
            "orchestration_fraction": orchestration / step_time, "bound_seconds": bound,
            "step_over_bound": step_time / bound, "k": k}


def run_one(workload: str, k: int, storage: str, steps: int) -> list[dict]:
    """Each step's metrics, with `time/step` the wall time of its `train_step` subflow."""
    import flows.train
    from trace_rl.runs.loading import load_config

    config = load_config(ROOT / "configs" / "demo.toml", [
        *WORKLOADS[workload], f"name=overlap-{workload}-k{k}", f"storage={storage}", f"steps={steps}",
        f"async.max_off_policy_steps={k}"])
    rows, subflow = [], flows.train.step_flow

    def timed_step(*args, **kwargs):
        started = time.perf_counter()
        result = subflow(*args, **kwargs)
        rows.append({**result["metrics"], "time/step": time.perf_counter() - started})
        return result

    flows.train.step_flow = timed_step
    try:
        flows.train.run_training(config)
    finally:
        flows.train.step_flow = subflow
    return rows


def reward_within(rows: list[dict], budget: float) -> tuple[int, float]:
    """(steps after step 1 finished within `budget` seconds, the mean reward of the last 3 of them)."""
    elapsed, done = 0.0, []
    for row in rows[1:]:
        elapsed += row["time/step"]
        if elapsed > budget:
            break
        done.append(row[REWARD_KEY])
    return len(done), sum(done[-3:]) / max(1, len(done[-3:]))


def run(steps: int = STEPS, workloads: tuple[str, ...] = tuple(WORKLOADS)) -> dict:
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-overlap-") as home:
        use_private_prefect(home)
        from flows import prefect_server

        server = prefect_server.start()
        os.environ["PREFECT_API_URL"] = server["api_url"]
        try:
            results = {}
            for workload in workloads:
                runs = {k: run_one(workload, k, os.path.join(home, "runs"), steps) for k in KS}
                # step 1 starts the engine (the first run of the process) and, with k >= 1, samples ahead alone
                budget = min(sum(r["time/step"] for r in rows[1:]) for rows in runs.values())
                summary = {f"k={k}": summarize(rows, steps, k) for k, rows in runs.items()}
                sync = summary["k=0"]["step_seconds"]
                for k, rows in runs.items():
                    done, reward = reward_within(rows, budget)
                    summary[f"k={k}"].update({"speedup": sync / summary[f"k={k}"]["step_seconds"],
                                              "steps_within_budget": done, "reward_within_budget": reward,
                                              "rewards": [r[REWARD_KEY] for r in rows]})
                results[workload] = {"overrides": WORKLOADS[workload], "budget_seconds": budget, "runs": summary}
            return {"steps": steps, "workloads": results, "target_speedup": TARGET_SPEEDUP,
                    "target_step_over_bound": TARGET_BOUND, "load_average": os.getloadavg()[0]}
        finally:
            from prefect.logging.handlers import APILogWorker

            from trace_rl.inference.vllm_engine import shutdown_engines

            shutdown_engines()  # else the process waits for its engine at exit

            APILogWorker.drain_all(timeout=5)
            prefect_server.stop()


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args()
    r = run(args.steps, tuple(args.workloads))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    for workload, w in r["workloads"].items():
        print(f"{workload} {w['overrides']}: budget {w['budget_seconds']:.1f} s")
        for k, s in w["runs"].items():
            print(f"  {k}: step {s['step_seconds']:.2f} s ({s['steps_per_s']:.3f} steps/s, speedup "
                  f"{s['speedup']:.2f}x), sample {s['sample_seconds']:.2f} train {s['train_seconds']:.2f} before "
                  f"{s['before_train_seconds']:.2f} orchestration {s['orchestration_seconds']:.2f} "
                  f"({s['orchestration_fraction']:.1%}); step/bound {s['step_over_bound']:.2f}; reward within "
                  f"budget {s['reward_within_budget']:.3f} after {s['steps_within_budget']} steps")


if __name__ == "__main__":
    main()
