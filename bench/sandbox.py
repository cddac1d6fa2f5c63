"""Rollouts per second of a code env with the model's programs in the sandbox (bubblewrap) and in podman against
run on the host, interleaved.

The workload: configs/code.toml's env (configs/verifiers/code_tasks.py, on trace-rl's chat harness), the real
SmolLM2-135M-Instruct (`smollm2-135m`, float32) on one in-process vLLM engine shared by both sides, a round of
`BATCH` tasks x `GROUP` rollouts played at once as a step plays them (`asyncio.gather` of the env's `rollout`),
at most 48 tokens at temperature 0.7. Each rollout samples one reply, then the task writes the reply's program
into the rollout's runtime and runs it. The sides differ only in that runtime:

- `host`: verifiers' `subprocess` runtime, the program run on the host as the trainer (what the default was);
- `bwrap`: trace-rl's default sandbox (`trace_rl/sandbox/`, docs/sandbox.md): the program under bubblewrap;
- `podman`: verifiers' podman runtime on the image `trace-rl sandbox build` makes, with trace-rl's defaults (no
  network but the rollout's routes), which is trace-rl's `RoutedPodmanRuntime` where podman runs as root (as
  here): one container per rollout with no network device, started as the episode starts and removed after it,
  its commands run with `runc exec` (docs/containers.md#what-a-container-costs).

Both sides play the same tasks with the same seeds each round, so they sample the same tokens; the order of the
sides rotates by round so that a shared machine's load hits both alike. Round 0 (the engine's and the first
container's warm-up) is left out. Reported: rollouts per second of each side over the measured rounds (rollouts
over the rounds' wall time), each sandboxed side's ratio to `host` (target `TARGET`: at least 0.8x), the mean reward
of each side
(equal rewards say both ran the same programs to the same outputs) and the failed rollouts.

    python -m bench.sandbox [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

ROUNDS = 5
BATCH, GROUP = 4, 8
TARGET = 0.8
SIDES = {"host": {"type": "subprocess"}, "bwrap": {"type": "bwrap"}, "podman": {"type": "podman"}}
TASKSETS = str(Path(__file__).resolve().parents[1] / "configs" / "verifiers")


async def play_round(env, runtime, examples, round_seed: int) -> tuple[list[float], int]:
    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Sampler, derive_seed

    sampling = SamplingConfig(temperature=0.7, max_completion_tokens=48)
    rollouts = [env.rollout(example, Sampler(runtime, sampling, seed=derive_seed(round_seed, k)))
                for example in examples for k in range(GROUP)]
    results = await asyncio.gather(*rollouts, return_exceptions=True)
    rewards = [trace.reward for result in results if not isinstance(result, BaseException) for trace in result]
    return rewards, sum(isinstance(result, BaseException) for result in results)


def run(rounds: int = ROUNDS) -> dict:
    from trace_rl.containers.image import build
    from trace_rl.envs.lookup import load_env
    from trace_rl.inference.build import build_runtime
    from trace_rl.inference.vllm_engine import shutdown_engines
    from trace_rl.models.hub import resolve_model_path
    from trace_rl.models.runtime import RuntimeConfig

    build()
    runtime = build_runtime(RuntimeConfig(key="policy", name=resolve_model_path("smollm2-135m"), backend="vllm",
                                          max_model_len=1024, step_sequences=BATCH * GROUP))
    envs = {side: load_env("verifiers", {"taskset": {"id": "code_tasks"},
                                         "agent": {"runtime": spec, "network_notice": False}}, [TASKSETS])
            for side, spec in SIDES.items()}
    seconds = {side: 0.0 for side in SIDES}
    rewards: dict[str, list[float]] = {side: [] for side in SIDES}
    failed = {side: 0 for side in SIDES}
    try:
        for round_index in range(rounds + 1):
            shift = round_index % len(SIDES)
            order = [*list(SIDES)[shift:], *list(SIDES)[:shift]]
            for side in order:
                examples = envs[side].examples(seed=round_index, count=BATCH)
                start = time.perf_counter()
                got, errors = asyncio.run(play_round(envs[side], runtime, examples, round_index))
                elapsed = time.perf_counter() - start
                print(f"round {round_index} {side}: {elapsed:.1f} s, {errors} failed", flush=True)
                if round_index:
                    seconds[side] += elapsed
                    rewards[side] += got
                    failed[side] += errors
    finally:
        shutdown_engines()
    rollouts = rounds * BATCH * GROUP
    result = {side: {"rollouts_per_s": rollouts / seconds[side], "seconds": seconds[side],
                     "mean_reward": sum(rewards[side]) / max(len(rewards[side]), 1), "failed": failed[side]}
              for side in SIDES}
    for side in SIDES:
        if side != "host":
            result[f"{side}_over_host"] = result[side]["rollouts_per_s"] / result["host"]["rollouts_per_s"]
    result["target"] = TARGET
    result["rollouts_per_side"] = rollouts
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="measured rounds per side (after a warm-up one)")
    print(json.dumps(run(parser.parse_args().rounds), indent=2))


if __name__ == "__main__":
    main()
