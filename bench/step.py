"""Where a training step's time goes, and what Prefect and storage add to it.

Reference CPU workload (`reference_config`): the tiny model (Qwen2, hidden 128, 2 layers,
byte tokenizer; `trace_rl.models.tiny`), sampled with transformers generate (`inference.backend =
"hf"`), one env `reverse-text` with 8 examples x 8 rollouts (64 rollouts per step) of at most
32 completion tokens at temperature 1, grpo, one optimizer step per training step
(micro-batches of 4096 tokens, lr 1e-3), checkpoint and weight export every step.

The same steps run twice in one process, as two runs: a real Prefect run
(`flows.train.run_training`: the `train` flow with one `train_step` subflow per step, against
an embedded Prefect server on a free loopback port, state in a temporary TRACE_RL_HOME), and
the library alone (`trace_rl.pipeline.step.run_step`). They are interleaved step by step, so the load
of a shared machine hits both alike: the run flow's `train_step` is wrapped so that step `s`
of the library run executes right next to subflow `s` (before it on even steps, after it on
odd ones). Both are timed by the same stage clocks (bench/timers.py), and so is the run flow's
own work around its subflows (artifacts, progress); its one-time set-up is reported apart. Step 1 loads
models and builds the trainer, so only steps 2.. count ("warm" steps). The two runs sample
the same rollouts (same seeds), so their rewards match step for step.

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

TARGET_OVERHEAD = 0.05  # of the step
TARGET_OVERHEAD_S = 0.5  # per step
REWARD_KEY = "rollouts/reverse-text/reward_mean"
RUN_FLOW_WORK = ("publish", "update_progress")  # what flows.train does per step around its subflow
STEPS = 4
REFERENCE = {
    "model": "tiny", "backend": "hf", "env": "reverse-text", "examples_per_step": 8, "group_size": 8,
    "max_completion_tokens": 32, "algorithms": "grpo", "micro_batch_tokens": 1024, "lr": 1e-3,
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


def server_cpu_seconds(process) -> float:
    """CPU seconds of the Prefect server process and its children (the server competes for the same cores)."""
    return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


def stage_seconds(timed: dict[str, float]) -> float:
    return sum(v for k, v in timed.items() if not k.startswith(("io/", "trainer/", "flow/")))


def io_seconds(timed: dict[str, float]) -> float:
    return sum(v for k, v in timed.items() if k.startswith("io/"))


def summarize(rows: list[dict]) -> dict:
    """Per kind: median over warm steps of wall, time inside stages, outside them, Parquet I/O, each label."""
    labels = sorted({k for r in rows for k in r["timed"]})
    return {
        "wall": statistics.median(r["wall"] for r in rows),
        "run_flow_work": statistics.median(sum(v for k, v in r["timed"].items() if k.startswith("flow/"))
                                           for r in rows),
        "best_wall": min(r["wall"] for r in rows),
        "inside_stages": statistics.median(stage_seconds(r["timed"]) for r in rows),
        "outside_stages": statistics.median(r["wall"] - stage_seconds(r["timed"]) for r in rows),
        "parquet_io": statistics.median(io_seconds(r["timed"]) for r in rows),
        "labels": {label: statistics.median(r["timed"].get(label, 0.0) for r in rows) for label in labels},
    }


def run(steps: int = STEPS) -> dict:
    """A `steps`-step Prefect run and a library run, interleaved; overhead ratios over the warm steps."""
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-step-") as home:
        use_private_prefect(home)
        from flows import prefect_server

        server = prefect_server.start()
        os.environ["PREFECT_API_URL"] = server["api_url"]
        try:
            import psutil

            server_cpu = server_cpu_seconds(psutil.Process(server["pid"]))
            result = measure(home, steps)
            result["prefect_server_cpu_seconds_per_step"] = (
                server_cpu_seconds(psutil.Process(server["pid"])) - server_cpu) / steps
            return result
        finally:
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)
            prefect_server.stop()


def library_stepper(config, timers):
    """A function running step `s` of `config` through `trace_rl.pipeline.step.run_step` alone: its wall seconds,
    timed stages, and the rollouts' and trainer's metrics."""
    from trace_rl.pipeline.session import session_for
    from trace_rl.pipeline.step import run_step
    from trace_rl.runs.start import prepare_run

    prepare_run(config, "new")
    session = session_for(config)

    def step_once(step: int) -> dict:
        timers.take()
        started = time.perf_counter()
        result = run_step(session, step)
        return {"step": step, "wall": time.perf_counter() - started, "timed": timers.take(),
                "rollout_metrics": result["rollouts"]["metrics"], "train_metrics": result["train"]["metrics"]}

    return step_once


def reward_row(row: dict) -> dict:
    """A `library_stepper` row as this bench records it: its wall, timed stages and reward."""
    return {"step": row["step"], "wall": row["wall"], "timed": row["timed"],
            "reward": row["rollout_metrics"][REWARD_KEY]}


def run_interleaved(flow_config, library_step, timers) -> dict:
    """The run through `flows.train.run_training`, each `train_step` subflow timed, and next to each
    (before it on even steps, after it on odd ones) the same step of the library run."""
    import flows.train

    rows: dict[str, list[dict]] = {"flow": [], "library": []}
    subflow = flows.train.step_flow

    def attach_around() -> None:  # the run flow's timed work since the previous subflow (publish, progress)
        around = timers.take()
        if rows["flow"]:
            rows["flow"][-1]["timed"].update({k: v for k, v in around.items() if k.startswith("flow/")})

    def timed_step(config, step, **kwargs):
        attach_around()
        if step % 2 == 0:
            rows["library"].append(reward_row(library_step(step)))
        timers.take()
        started = time.perf_counter()
        result = subflow(config, step, **kwargs)
        rows["flow"].append({"step": step, "wall": time.perf_counter() - started, "timed": timers.take(),
                             "reward": result["metrics"][REWARD_KEY],
                             "flow_clock": {k.removeprefix("time/"): v for k, v in result["metrics"].items()
                                            if k.startswith("time/")}})
        if step % 2 == 1:
            rows["library"].append(reward_row(library_step(step)))
        return result

    flows.train.step_flow = timed_step
    for name in RUN_FLOW_WORK:
        timers.patch(flows.train, name, lambda args, kwargs, name=name: f"flow/{name}")
    try:
        started = time.perf_counter()
        flows.train.run_training(flow_config)
        total = time.perf_counter() - started
        attach_around()
    finally:
        flows.train.step_flow = subflow
    library_total = sum(r["wall"] for r in rows["library"])
    return {"rows": rows, "flow_total": total - library_total, "library_total": library_total}


def measure(home: str, steps: int) -> dict:
    storage = os.path.join(home, "runs")
    with pipeline_timers() as timers:
        load_before = os.getloadavg()[0]
        library_step = library_stepper(reference_config(storage, "bench-library", steps), timers)
        interleaved = run_interleaved(reference_config(storage, "bench-flow", steps), library_step, timers)
        loads = [load_before, os.getloadavg()[0]]
    runs = {"flow": {"rows": interleaved["rows"]["flow"], "total": interleaved["flow_total"]},
            "library": {"rows": interleaved["rows"]["library"], "total": interleaved["library_total"]}}
    warm = {kind: summarize(r["rows"][1:]) for kind, r in runs.items()}
    flow, library = warm["flow"], warm["library"]
    # the run flow's own work around its step subflows (artifacts, progress) per warm step; its one-time set-up
    flow_run_extra = flow["run_flow_work"]
    run_setup = runs["flow"]["total"] - sum(r["wall"] + sum(v for k, v in r["timed"].items() if k.startswith("flow/"))
                                            for r in runs["flow"]["rows"])
    prefect_overhead = (flow["wall"] + flow_run_extra) / library["wall"] - 1
    prefect_outside = (flow["outside_stages"] + flow_run_extra - library["outside_stages"]) / library["wall"]
    storage_share = library["parquet_io"] / library["wall"]
    overhead_seconds = flow["outside_stages"] + flow_run_extra - library["outside_stages"] + library["parquet_io"]
    flow_clock = [r["flow_clock"] for r in runs["flow"]["rows"][1:]]
    return {
        "workload": REFERENCE, "steps": steps, "warm_steps": steps - 1,
        "first_step_wall": {kind: r["rows"][0]["wall"] for kind, r in runs.items()},
        "total_wall": {kind: r["total"] for kind, r in runs.items()},
        "warm": warm,
        "flow_run_extra_per_step": flow_run_extra,
        "flow_run_setup_seconds": run_setup,
        "flow_task_clock": {k: statistics.median(c.get(k, 0.0) for c in flow_clock) for k in flow_clock[0]},
        "prefect_overhead": prefect_overhead,
        "prefect_overhead_outside_stages": prefect_outside,
        "storage_overhead": storage_share,
        "total_overhead": prefect_outside + storage_share,
        "target_overhead": TARGET_OVERHEAD,
        "meets_target": prefect_outside + storage_share < TARGET_OVERHEAD,
        "overhead_seconds": overhead_seconds,
        "target_overhead_seconds": TARGET_OVERHEAD_S,
        "meets_target_seconds": overhead_seconds <= TARGET_OVERHEAD_S,
        "rewards": {kind: [row["reward"] for row in r["rows"]] for kind, r in runs.items()},
        "load_average": max(loads),
        "steps_raw": {kind: r["rows"] for kind, r in runs.items()},
    }


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args()
    r = run(args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    flow, library = r["warm"]["flow"], r["warm"]["library"]
    print(f"reference workload {r['workload']}; {r['warm_steps']} warm steps; max load average "
          f"{r['load_average']:.2f}")
    print(f"{'label':<28} {'flow s':>8} {'library s':>10}")
    for label in sorted(set(flow["labels"]) | set(library["labels"])):
        print(f"{label:<28} {flow['labels'].get(label, 0):>8.3f} {library['labels'].get(label, 0):>10.3f}")
    for key in ("wall", "inside_stages", "outside_stages", "parquet_io"):
        print(f"{key:<28} {flow[key]:>8.3f} {library[key]:>10.3f}")
    print(f"run flow's work around its steps: {r['flow_run_extra_per_step']:.3f} s/step; Prefect server CPU "
          f"{r['prefect_server_cpu_seconds_per_step']:.2f} s/step")
    print(f"Prefect overhead {r['prefect_overhead']:+.1%} (step vs step), {r['prefect_overhead_outside_stages']:+.1%} "
          f"(outside the stages); storage {r['storage_overhead']:.1%}; target < {r['target_overhead']:.0%}: "
          f"{'met' if r['meets_target'] else 'NOT met'}")
    print(f"Prefect + storage per step: {r['overhead_seconds']:.3f} s; target <= {r['target_overhead_seconds']} s: "
          f"{'met' if r['meets_target_seconds'] else 'NOT met'}")


if __name__ == "__main__":
    main()
