"""Trainer peak memory per 1k tokens: full-vocabulary logits (before) against chunked logprobs (after).

Model: `trace_rl.models.realistic`'s random Qwen2 with Qwen's 151,936-token vocabulary (hidden 64,
2 layers, head_dim 32, tied embeddings: 9.8M parameters, nearly all of them the embedding),
float32 on CPU. Workload: one packed micro-batch of N tokens (4 samples of N/4 tokens, rl on
the second half of each) through `Trainer.optimizer_step` (forward, backward, AdamW step), after
a warm-up step on a few tokens that allocates the gradients and the optimizer state.

"before" sets `trainer.logprob_chunk = None`: the model's full (N x 151,936) float32 logits, a
log-softmax over all of them, both kept for backward. "after" is the trainer's default:
`chunk_positions(151,936)` = 110 positions at a time, each chunk recomputed in backward.

Each (variant, N) runs in a fresh subprocess; the figure is the growth of that process's peak
RSS (`ru_maxrss`) over the measured step: what the step needs on top of the model, its
gradients and optimizer state. Divided by N/1000 for the per-1k-token figure.

    python -m bench.memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TOKENS = (2048, 4096)
VARIANTS = ("before", "after")
SAMPLES_PER_BATCH = 4


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def samples(tokens: int, vocabulary: int, seed: int = 0) -> list:
    from trace_rl.data.sample import TrainingSample

    rng = np.random.default_rng(seed)
    length = tokens // SAMPLES_PER_BATCH
    out = []
    for i in range(SAMPLES_PER_BATCH):
        completion = np.arange(length) >= length // 2
        out.append(TrainingSample(
            trace_id=f"memory-{i}", branch_index=0, env="bench", input_ids=rng.integers(0, vocabulary, length)
            .astype(np.int32), temperature=1.0, sampled=completion,
            inference_logprobs=np.where(completion, -12.0, 0.0).astype(np.float32),
            rl_values=np.where(completion, rng.normal(0, 1, length), 0).astype(np.float32), rl_mask=completion,
            ce_values=np.zeros(length, np.float32), ce_mask=np.zeros(length, bool),
        ))
    return out


def measure(variant: str, tokens: int, model_dir: str) -> dict:
    """One measured train_step in this process (call it in a fresh one)."""
    import torch

    from trace_rl.config import Config
    from trace_rl.storage import RunStorage
    from trace_rl.trainer.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="trace-rl-memory-") as tmp:
        config = Config(name="memory", storage=tmp, env=[{"id": "bench"}],
                        model={"name": model_dir, "dtype": "float32"}, inference={"max_model_len": tokens},
                        trainer={"micro_batch_tokens": tokens, "device": "cpu", "lr": 1e-5})
        trainer = Trainer(config, RunStorage.of(config))
        if variant == "before":
            trainer.logprob_chunk = None
        vocabulary = trainer.module.config.vocab_size
        trainer.optimizer_step(0, samples(64, vocabulary, seed=1))  # gradients and AdamW state now exist
        batch = samples(tokens, vocabulary)
        baseline = peak_rss_mb()
        started = time.perf_counter()
        metrics = trainer.optimizer_step(1, batch)
        seconds = time.perf_counter() - started
        peak = peak_rss_mb()
        parameters = sum(p.numel() for p in trainer.module.parameters())
    return {"variant": variant, "tokens": tokens, "vocabulary": vocabulary, "parameters": parameters,
            "micro_batches": metrics["micro_batches"], "baseline_rss_mb": baseline, "peak_rss_mb": peak,
            "step_growth_mb": peak - baseline, "mb_per_1k_tokens": (peak - baseline) / (tokens / 1000),
            "seconds": seconds, "threads": torch.get_num_threads(), "loss": metrics["loss"]}


def build_model(cache_root: Path) -> str:
    from trace_rl.models.realistic import build_realistic_model

    return str(build_realistic_model(cache_root))


def run() -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="trace-rl-memory-model-") as tmp:
        model_dir = build_model(Path(tmp))
        for tokens in TOKENS:
            for variant in VARIANTS:
                command = [sys.executable, "-m", "bench.memory", "--one", variant, str(tokens), model_dir]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{variant} at {tokens} tokens failed:\n{(done.stdout + done.stderr)[-2000:]}")
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    by = {(r["variant"], r["tokens"]): r for r in rows}
    return {
        "rows": rows,
        "reduction": {str(t): by[("before", t)]["step_growth_mb"] / by[("after", t)]["step_growth_mb"]
                      for t in TOKENS},
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=3, metavar=("VARIANT", "TOKENS", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        variant, tokens, model_dir = args.one
        print(json.dumps(measure(variant, int(tokens), model_dir)))
        return
    result = run()
    first = result["rows"][0]
    print(f"Qwen2, vocabulary {first['vocabulary']:,}, {first['parameters'] / 1e6:.1f}M parameters, float32 on CPU, "
          f"{first['threads']} threads, load average {result['load_average']:.2f}")
    print(f"{'tokens':>7} {'variant':>8} {'step peak growth MB':>20} {'MB per 1k tokens':>17} {'seconds':>8}")
    for r in result["rows"]:
        print(f"{r['tokens']:>7} {r['variant']:>8} {r['step_growth_mb']:>20,.0f} {r['mb_per_1k_tokens']:>17,.0f} "
              f"{r['seconds']:>8.1f}")
    for tokens, ratio in result["reduction"].items():
        print(f"{tokens} tokens: before / after = {ratio:.1f}x")


if __name__ == "__main__":
    main()
