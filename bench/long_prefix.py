"""The trainer on samples sharing a long prefix, with `trainer.share_prefixes` on and off.

Model: SmolLM2-135M (`smollm2-135m`, docs/models.md), float32 on CPU. Cases (random tokens, rl on each
sample's own tokens): `group`, 8 samples sharing a 1,024-token prompt with 64-token completions (a GRPO group
of a long agentic prompt); `branches`, a trace's two branches sharing 1,024 tokens of history with 64 tokens
each. Micro-batches of 2,304 distinct positions on both sides: unshared, two samples each (8,704 tokens in 4
micro-batches for the group); shared, the whole group in one (1,536 positions).

Per case and side, in a fresh process (its peak RSS is that configuration's): one warm-up `Trainer.optimizer_step`,
then one timed; the distinct positions, the samples' tokens and the output layer's rows (`output_positions`).
The floor of a step: the distinct positions' training FLOPs (6 x parameters each) at the best float32
2048^2-matmul rate measured in the same process just before and after its timed step (this machine's rate
swings up to 2x between minutes, so one rate for all rows would mismeasure some of them). Targets (issue
37): the shared step >= 4x faster than unshared at a lower peak RSS; the shared step within 1.3x of its floor.

    python -m bench.long_prefix
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

MODEL = "smollm2-135m"
CASES = {"group": (8, 1024, 64), "branches": (2, 1024, 64)}  # samples, shared tokens, own tokens each
MICRO_BATCH_TOKENS = 2304
TARGET_SPEEDUP, TARGET_OVER_FLOOR = 4.0, 1.3


def workload(case: str, vocab: int, seed: int = 0) -> list:
    """`CASES[case]`: samples of one shared prefix and their own tokens, rl on their own tokens (temperature 1)."""
    from trace_rl.data.sample import TrainingSample

    count, shared, own = CASES[case]
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, shared)
    samples = []
    for i in range(count):
        ids = np.concatenate([prefix, rng.integers(0, vocab, own)]).astype(np.int32)
        completion = np.arange(len(ids)) >= shared
        samples.append(TrainingSample(
            trace_id=f"{case}-{i}", branch_index=i, env="bench", input_ids=ids, temperature=1.0, sampled=completion,
            inference_logprobs=np.where(completion, -10.0, 0.0).astype(np.float32),
            rl_values=np.where(completion, rng.normal(0, 1, len(ids)), 0).astype(np.float32), rl_mask=completion,
            ce_values=np.zeros(len(ids), np.float32), ce_mask=np.zeros(len(ids), bool),
        ))
    return samples


def side(case: str, share: bool) -> dict:
    """A warm-up and a timed `train_step` of one case, in this process."""
    from bench.trl import matmul_gflops
    from trace_rl.config import Config
    from trace_rl.models.hub import resolve_model_path
    from trace_rl.storage import RunStorage
    from trace_rl.trainer.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-") as tmp:
        config = Config(name="bench", storage=os.path.join(tmp, "runs"), env=[{"id": "bench"}],
                        model={"name": resolve_model_path(MODEL), "dtype": "float32"},
                        trainer={"micro_batch_tokens": MICRO_BATCH_TOKENS, "lr": 1e-5, "device": "cpu",
                                 "share_prefixes": share})
        trainer = Trainer(config, RunStorage.of(config))
        samples = workload(case, trainer.module.config.vocab_size)
        trainer.optimizer_step(0, samples)
        rate_before = matmul_gflops("float32")
        start = time.perf_counter()
        metrics = trainer.optimizer_step(1, samples)
        seconds = time.perf_counter() - start
        gflops = max(rate_before, matmul_gflops("float32"))
        parameters = sum(p.numel() for p in trainer.module.parameters())
    return {"case": case, "share_prefixes": share, "seconds": seconds, "parameters": parameters,
            "distinct_positions": metrics["tokens"], "sample_tokens": metrics["sample_tokens"],
            "output_positions": metrics["output_positions"], "micro_batches": metrics["micro_batches"],
            "matmul_gflops": gflops, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run() -> dict:
    rows = []
    for case in CASES:
        for share in (True, False):
            out = subprocess.run([sys.executable, "-m", "bench.long_prefix", "--side", case, str(share)],
                                 capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    for row in rows:
        row["floor_seconds"] = 6 * row["parameters"] * row["distinct_positions"] / (row["matmul_gflops"] * 1e9)
        row["step_over_floor"] = row["seconds"] / row["floor_seconds"]
    cases = {}
    for case in CASES:
        on, off = (next(r for r in rows if r["case"] == case and r["share_prefixes"] is s) for s in (True, False))
        cases[case] = {"speedup": off["seconds"] / on["seconds"],
                       "peak_rss_ratio": on["peak_rss_mb"] / off["peak_rss_mb"],
                       "shared_over_floor": on["step_over_floor"]}
    return {"rows": rows, "cases": cases, "load_average": os.getloadavg()[0]}


def main() -> None:
    if sys.argv[1:2] == ["--side"]:
        case, share = sys.argv[2:4]
        print(json.dumps(side(case, share == "True")))
        return
    result = run()
    for row in result["rows"]:
        print(f"{row['case']:<9} share_prefixes={str(row['share_prefixes']):<5} {row['seconds']:7.2f} s/step  "
              f"peak RSS {row['peak_rss_mb']:7,.0f} MB  {row['distinct_positions']:6,.0f} distinct positions of "
              f"{row['sample_tokens']:6,.0f}  matmul {row['matmul_gflops']:.0f} GFLOP/s  "
              f"step/floor {row['step_over_floor']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
