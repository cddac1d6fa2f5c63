"""Throughput of the algorithm path: grpo + echo + validate + aggregate on a synthetic step.

The step has 1024 branches of 1024 tokens (128 groups of 8 rollouts), each a multi-turn
tool conversation: system, user, then four rounds of a sampled assistant turn and a tool
result. Runs on one thread; reports the best of `repeats` runs per stage, wall and CPU time.
The target is per core: tokens per CPU-second of that one thread (on a quiet core the same as
per wall second; on a shared machine wall time also counts the time the process waited for a core).

    python -m bench.algorithms
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from trace_rl.algorithms import load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.data.trace import Branch, Message, Trace
from trace_rl.data.validate import validate_channels
from trace_rl.pipeline.channels import sum_channels

TARGET_TOKENS_PER_S = 20e6
# (role, content tokens, sampled) per message: header + content + end token each, 1024 tokens in all
TOKENS_PER_BRANCH = 1024
LAYOUT = [("system", 60, False), ("user", 100, False)] + [("assistant", 140, True), ("tool", 70, False)] * 4
LAYOUT[-1] = ("tool", TOKENS_PER_BRANCH - sum(n + 2 for _, n, _ in LAYOUT[:-1]) - 2, False)


def branch_arrays() -> dict[str, np.ndarray]:
    message_index, sampled, is_content = [], [], []
    for index, (_, tokens, was_sampled) in enumerate(LAYOUT):
        message_index += [-1 if was_sampled else index] + [index] * (tokens + 1)
        sampled += [False] + [was_sampled] * (tokens + 1)
        is_content += [False] + [True] * tokens + [False]
    sampled = np.array(sampled)
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(0, 50_000, len(sampled)), "sampled": sampled,
        "logprobs": np.where(sampled, -rng.random(len(sampled)), 0.0), "message_index": np.array(message_index),
        "is_content": np.array(is_content),
    }


def synthetic_step(groups: int = 128, group_size: int = 8) -> list[Trace]:
    arrays = branch_arrays()
    messages = [Message(role=role, content="x" * tokens) for role, tokens, _ in LAYOUT]
    rewards = np.random.default_rng(1).random(groups * group_size)
    return [
        Trace(id=f"t{g}-{i}", env="bench", example_id=f"e{g}", group_id=f"g{g}", messages=messages,
              reward=float(rewards[g * group_size + i]),
              branches=[Branch(**{name: value.copy() for name, value in arrays.items()})])
        for g in range(groups) for i in range(group_size)
    ]


STAGES = ("grpo", "echo", "validate", "aggregate")


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def run(repeats: int = 10) -> dict:
    """Best-of-`repeats` wall and CPU seconds per stage and the overall tokens/s, on one thread.

    Everything runs in this one thread (numpy's elementwise kernels do not multi-thread),
    so it uses one core at a time. CPU time is reported next to wall time because a
    shared machine deschedules the process; on a quiet core the two agree.
    """
    traces = synthetic_step()
    tokens = sum(len(b) for t in traces for b in t.branches)
    grpo, echo = load_algorithm("grpo"), load_algorithm({"id": "echo", "user": {"alpha": 0.5}})
    wall = {stage: float("inf") for stage in STAGES}
    cpu = dict(wall)

    def record(stage, fn):
        seconds, cpu_seconds, result = timed(fn)
        wall[stage], cpu[stage] = min(wall[stage], seconds), min(cpu[stage], cpu_seconds)
        return result

    for _ in range(repeats):
        grpo_channels = record("grpo", lambda: asyncio.run(apply_algorithm(grpo, traces)))
        echo_channels = record("echo", lambda: asyncio.run(apply_algorithm(echo, traces)))
        channels = grpo_channels + echo_channels
        record("validate", lambda: validate_channels(traces, channels))
        samples = record("aggregate", lambda: sum_channels(traces, channels))
    total_wall, total_cpu = sum(wall.values()), sum(cpu.values())
    return {
        "tokens": tokens, "branches": len(traces), "samples": len(samples), "channels": len(channels),
        "wall_seconds": wall, "cpu_seconds": cpu, "total_wall_seconds": total_wall, "total_cpu_seconds": total_cpu,
        "tokens_per_s": tokens / total_wall, "tokens_per_cpu_s": tokens / total_cpu,
        "target_tokens_per_s": TARGET_TOKENS_PER_S, "meets_target": tokens / total_cpu >= TARGET_TOKENS_PER_S,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    result = run()
    print(f"{result['tokens']:,} tokens, {result['branches']} branches, {result['channels']} channels, "
          f"{result['samples']} samples; one thread; load average {result['load_average']:.2f}")
    print(f"{'stage':<10} {'wall ms':>8} {'Mtok/s':>8} {'cpu ms':>8} {'Mtok/cpu-s':>11}")
    tokens = result["tokens"]
    rows = [(stage, result["wall_seconds"][stage], result["cpu_seconds"][stage]) for stage in STAGES]
    for stage, wall, cpu in [*rows, ("total", result["total_wall_seconds"], result["total_cpu_seconds"])]:
        print(f"{stage:<10} {wall * 1e3:>8.2f} {tokens / wall / 1e6:>8.1f} "
              f"{cpu * 1e3:>8.2f} {tokens / cpu / 1e6:>11.1f}")
    print(f"target {TARGET_TOKENS_PER_S / 1e6:.0f}M tokens per CPU-second (one core): "
          f"{'met' if result['meets_target'] else 'NOT met'}")


if __name__ == "__main__":
    main()
