"""Weight broadcast per step, full weights vs a LoRA adapter: bytes written and seconds.

Model: `trace_rl.models.realistic`'s random Qwen2 (Qwen's 151,936-token vocabulary, hidden 64, 2 layers;
float32). Each variant trains `STEPS` real trainer steps on a synthetic batch; after each, the
step's broadcast is timed in its two halves, what a training step does after the optimizer step:

- export: `Trainer.export_weights` writes `weights/<step>/` (full: HF safetensors + config +
  tokenizer; LoRA: the peft adapter, rank 16 on every attention and MLP projection);
- load: `broadcast_weights` into an in-process vLLM engine (full: in-place reload of every tensor;
  LoRA: the adapter loaded as a new `LoRARequest`, the previous one removed).

Bytes are the files of `weights/<step>/`. Medians over the steps after the first. The realistic
fixture is tiny in its blocks and huge in its embedding, so the ratio here is far below a real
model's; the LoRA/full byte ratio of Qwen2.5-7B at the same rank is computed from its shapes
(`QWEN25_7B`, bf16) for scale.

    python -m bench.lora
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

STEPS = 4
RANK = 16
QWEN25_7B = {"hidden": 3584, "intermediate": 18944, "layers": 28, "kv_dim": 512, "vocab": 152064,
             "parameters": 7_615_616_512}


def lora_parameters(shape: dict, rank: int) -> int:
    """r * (d_in + d_out) per adapted projection (A: r x d_in, B: d_out x r), q/k/v/o and gate/up/down."""
    h, i, kv = shape["hidden"], shape["intermediate"], shape["kv_dim"]
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h)
    return rank * per_layer * shape["layers"]


def synthetic_batch(seed: int, vocabulary: int):
    from trace_rl.data.sample import TrainingSample

    rng = np.random.default_rng(seed)
    samples = []
    for index in range(8):
        length = 64
        sampled = np.arange(length) >= length // 2
        samples.append(TrainingSample(
            trace_id=f"t{seed}-{index}", branch_index=0, env="bench",
            input_ids=rng.integers(0, vocabulary, length).astype(np.int32), temperature=1.0, sampled=sampled,
            inference_logprobs=np.where(sampled, -5.0, 0.0).astype(np.float32),
            rl_values=np.where(sampled, rng.normal(0, 1, length), 0.0).astype(np.float32), rl_mask=sampled,
            ce_values=np.zeros(length, np.float32), ce_mask=np.zeros(length, bool)))
    return samples


def directory_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def measure(variant: str, model_dir: str, storage_root: str) -> dict:
    from trace_rl.config import Config
    from trace_rl.inference.broadcast import broadcast_weights
    from trace_rl.inference.build import build_runtime
    from trace_rl.names import POLICY
    from trace_rl.pipeline.colocation import runtime_configs
    from trace_rl.storage import RunStorage
    from trace_rl.trainer.trainer import Trainer

    model = {"name": model_dir, **({"lora": {"rank": RANK, "alpha": 2.0 * RANK}} if variant == "lora" else {})}
    config = Config(name=variant, storage=storage_root, env=[{"id": "reverse-text"}], model=model,
                    inference={"backend": "vllm", "max_model_len": 256, "cpu_kv_cache_gb": 0.25},
                    trainer={"lr": 1e-3, "device": "cpu", "micro_batch_tokens": 512})
    storage = RunStorage.of(config)
    trainer = Trainer(config, storage)
    runtime = build_runtime(runtime_configs(config)[POLICY])
    vocabulary = len(runtime.tokenizer)
    rows = []
    for step in range(1, STEPS + 1):
        trainer.optimizer_step(step, synthetic_batch(step, vocabulary))
        started = time.perf_counter()
        directory = trainer.export_weights(step)
        exported = time.perf_counter()
        asyncio.run(broadcast_weights(runtime, storage, step))
        loaded = time.perf_counter()
        rows.append({"bytes": directory_bytes(directory), "export_seconds": exported - started,
                     "load_seconds": loaded - exported, "broadcast_seconds": loaded - started})
    warm = rows[1:]
    return {
        "trainable_parameters": sum(p.numel() for p in trainer.module.parameters() if p.requires_grad),
        "model_parameters": sum(p.numel() for n, p in trainer.module.named_parameters() if ".lora_" not in n),
        "bytes": statistics.median(r["bytes"] for r in warm),
        **{key: statistics.median(r[key] for r in warm)
           for key in ("export_seconds", "load_seconds", "broadcast_seconds")},
    }


def run() -> dict:
    from trace_rl.models.realistic import build_realistic_model
    from trace_rl.inference.vllm_engine import shutdown_engines

    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-lora-") as tmp:
        model_dir = str(build_realistic_model(Path(tmp) / "hub"))
        try:
            variants = {name: measure(name, model_dir, os.path.join(tmp, "runs")) for name in ("full", "lora")}
        finally:
            shutdown_engines()
    full, lora = variants["full"], variants["lora"]
    adapter_7b = lora_parameters(QWEN25_7B, RANK)
    return {
        "model": "trace-rl/qwen2-fixture (float32)", "rank": RANK, "steps": STEPS, "variants": variants,
        "bytes_ratio": full["bytes"] / lora["bytes"],
        "broadcast_speedup": full["broadcast_seconds"] / lora["broadcast_seconds"],
        "qwen25_7b": {"full_bytes_bf16": QWEN25_7B["parameters"] * 2, "adapter_parameters": adapter_7b,
                      "adapter_bytes_bf16": adapter_7b * 2, "bytes_ratio": QWEN25_7B["parameters"] / adapter_7b},
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    result = run()
    print(f"{result['model']}, LoRA rank {result['rank']}, medians of steps 2..{result['steps']}")
    print(f"{'variant':>8} {'MB':>10} {'export s':>9} {'load s':>9} {'broadcast s':>12}")
    for name, r in result["variants"].items():
        print(f"{name:>8} {r['bytes'] / 1e6:>10.3f} {r['export_seconds']:>9.3f} {r['load_seconds']:>9.3f} "
              f"{r['broadcast_seconds']:>12.3f}")
    print(f"full / LoRA: {result['bytes_ratio']:.0f}x the bytes, {result['broadcast_speedup']:.1f}x the time")
    q = result["qwen25_7b"]
    print(f"Qwen2.5-7B at rank {result['rank']} (computed): {q['full_bytes_bf16'] / 1e9:.1f} GB full vs "
          f"{q['adapter_bytes_bf16'] / 1e6:.0f} MB adapter (bf16), {q['bytes_ratio']:.0f}x")


if __name__ == "__main__":
    main()
