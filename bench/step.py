"""Where a training step's time goes, and what Prefect and storage add to it.

Reference CPU workload (`reference_config`): the tiny model (Qwen2, hidden 128, 2 layers,
byte tokenizer; `trace_rl.tiny`), sampled with transformers generate (`inference.backend =
"hf"`), one env `reverse-text` with 8 examples x 8 rollouts (64 rollouts per step) of at most
32 completion tokens at temperature 1, grpo, one optimizer step per training step
(micro-batches of 4096 tokens, lr 1e-3), checkpoint and weight export every step.

The same steps run twice in one process, interleaved step by step so machine load hits
both alike: through the real `train_step` Prefect flow (an embedded Prefect server on a
free loopback port, state in a temporary TRACE_RL_HOME) and through the library alone
(`trace_rl.step.run_step`). Both are timed by the same stage clocks (bench/timers.py).
Step 1 loads models and builds the trainer, so only steps 2.. count ("warm" steps).

- Prefect overhead: flow step minus library step, as a fraction of the library step;
  also measured as the time the flow spends outside the stage functions (task runs, cache
  keys, result persistence, metrics, artifacts) minus the same for the library loop, which
  is not blurred by run-to-run noise in sampling and training.
- Storage overhead: the Parquet writes and reads between stages (traces, channels, batch),
  which an in-memory loop would not do. Checkpoints and weight export are counted inside
  `train` (a run needs them to resume and to broadcast).

    python -m bench.step
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from bench.timers import pipeline_timers

TARGET_OVERHEAD = 0.05
REWARD_KEY = "rollouts/reverse-text/reward_mean"
STEPS = 4
REFERENCE = {
    "model": "tiny", "backend": "hf", "env": "reverse-text", "examples_per_step": 8, "group_size": 8,
    "max_completion_tokens": 32, "algorithms": "grpo", "micro_batch_tokens": 4096, "lr": 1e-3,
}


def reference_config(storage: str, name: str, steps: int):
    from trace_rl.config import Config

    r = REFERENCE
    return Config(
        name=name, steps=steps, seed=0, storage=storage,
        model={"name": r["model"]}, inference={"backend": r["backend"]},
        sampling={"max_completion_tokens": r["max_completion_tokens"], "temperature": 1.0},
        env=[{"id": r["env"], "batch_size": r["examples_per_step"], "group_size": r["group_size"]}],
        algorithms=[r["algorithms"]],
        trainer={"lr": r["lr"], "micro_batch_tokens": r["micro_batch_tokens"]},
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_private_prefect(home: str) -> None:
    """Point this process at a Prefect server of its own (set before prefect is imported)."""
    os.environ.update({
        "TRACE_RL_HOME": home, "TRACE_RL_PREFECT_PORT": str(free_port()),
        "PREFECT_HOME": os.path.join(home, "prefect-client"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    })
    os.environ.pop("PREFECT_API_URL", None)


def stage_seconds(timed: dict[str, float]) -> float:
    return sum(v for k, v in timed.items() if not k.startswith(("io/", "trainer/")))


def io_seconds(timed: dict[str, float]) -> float:
    return sum(v for k, v in timed.items() if k.startswith("io/"))


def summarize(rows: list[dict]) -> dict:
    """Per kind: median over warm steps of wall, time inside stages, outside them, Parquet I/O, each label."""
    labels = sorted({k for r in rows for k in r["timed"]})
    return {
        "wall": statistics.median(r["wall"] for r in rows),
        "best_wall": min(r["wall"] for r in rows),
        "inside_stages": statistics.median(stage_seconds(r["timed"]) for r in rows),
        "outside_stages": statistics.median(r["wall"] - stage_seconds(r["timed"]) for r in rows),
        "parquet_io": statistics.median(io_seconds(r["timed"]) for r in rows),
        "labels": {label: statistics.median(r["timed"].get(label, 0.0) for r in rows) for label in labels},
    }


def run(steps: int = STEPS) -> dict:
    """Interleave `steps` flow steps and `steps` library steps; overhead ratios over the warm steps."""
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-step-") as home:
        use_private_prefect(home)
        from trace_rl import prefect_server

        os.environ["PREFECT_API_URL"] = prefect_server.start()["api_url"]
        try:
            return measure(home, steps)
        finally:
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)
            prefect_server.stop()


def measure(home: str, steps: int) -> dict:
    from flows.step import train_step
    from trace_rl.run import prepare_run
    from trace_rl.session import session_for
    from trace_rl.step import run_step

    storage = os.path.join(home, "runs")
    configs = {kind: reference_config(storage, f"bench-{kind}", steps) for kind in ("flow", "library")}
    for config in configs.values():
        prepare_run(config, "new")
    runners = {
        "flow": lambda step: train_step(configs["flow"], step),
        "library": lambda step: run_step(session_for(configs["library"]), step),
    }
    rows: dict[str, list[dict]] = {"flow": [], "library": []}
    flow_clock: list[dict] = []
    rewards: dict[str, list[float]] = {"flow": [], "library": []}
    loads = []
    with pipeline_timers() as timers:
        for step in range(1, steps + 1):
            order = ("flow", "library") if step % 2 else ("library", "flow")
            for kind in order:
                timers.take()
                started = time.perf_counter()
                result = runners[kind](step)
                wall = time.perf_counter() - started
                rows[kind].append({"step": step, "wall": wall, "timed": timers.take()})
                loads.append(os.getloadavg()[0])
                if kind == "flow":
                    metrics = result["metrics"]
                    flow_clock.append({k.removeprefix("time/"): v for k, v in metrics.items()
                                       if k.startswith("time/")})
                    rewards[kind].append(metrics[REWARD_KEY])
                else:
                    rewards[kind].append(result["rollouts"]["metrics"][REWARD_KEY])
    warm = {kind: summarize(r[1:]) for kind, r in rows.items()}
    flow, library = warm["flow"], warm["library"]
    prefect_overhead = flow["wall"] / library["wall"] - 1
    prefect_outside = (flow["outside_stages"] - library["outside_stages"]) / library["wall"]
    storage_share = library["parquet_io"] / library["wall"]
    return {
        "workload": REFERENCE, "steps": steps, "warm_steps": steps - 1,
        "first_step_wall": {kind: r[0]["wall"] for kind, r in rows.items()},
        "warm": warm,
        "flow_task_clock": {k: statistics.median(c.get(k, 0.0) for c in flow_clock[1:]) for k in flow_clock[0]},
        "prefect_overhead": prefect_overhead,
        "prefect_overhead_outside_stages": prefect_outside,
        "storage_overhead": storage_share,
        "total_overhead": prefect_outside + storage_share,
        "target_overhead": TARGET_OVERHEAD,
        "meets_target": prefect_outside + storage_share < TARGET_OVERHEAD,
        "rewards": rewards,
        "load_average": max(loads),
        "steps_raw": rows,
    }


def main() -> None:
    r = run()
    flow, library = r["warm"]["flow"], r["warm"]["library"]
    print(f"reference workload {r['workload']}; {r['warm_steps']} warm steps; max load average "
          f"{r['load_average']:.2f}")
    print(f"{'label':<28} {'flow s':>8} {'library s':>10}")
    for label in sorted(set(flow["labels"]) | set(library["labels"])):
        print(f"{label:<28} {flow['labels'].get(label, 0):>8.3f} {library['labels'].get(label, 0):>10.3f}")
    for key in ("wall", "inside_stages", "outside_stages", "parquet_io"):
        print(f"{key:<28} {flow[key]:>8.3f} {library[key]:>10.3f}")
    print(f"Prefect overhead {r['prefect_overhead']:+.1%} (step vs step), {r['prefect_overhead_outside_stages']:+.1%} "
          f"(outside the stages); storage {r['storage_overhead']:.1%}; target < {r['target_overhead']:.0%}: "
          f"{'met' if r['meets_target'] else 'NOT met'}")


if __name__ == "__main__":
    main()
