"""Trainer throughput: tokens/s of `Trainer.optimizer_step` (pack + forward + backward + optimizer step).

Workload: a Qwen2 model built in memory (hidden 256, 4 layers, 8 heads of 32, 4 KV
heads, MLP 768, the tiny byte tokenizer's vocabulary: 3.4M parameters), fp32 on
CPU or bf16 autocast on CUDA; a step of 16 samples of 64-255 tokens (2,355 tokens), rl on
the second half of each sample, packed into micro-batches of 1024 tokens.
Attention runs per sample (`trace_rl.trainer.varlen`), so it costs sum L^2 over the
samples of a micro-batch, not T^2; MFU counts that useful part.

Compared with a bare PyTorch loop over the same packed micro-batches (same model,
same per-sample attention, a plain cross-entropy, backward, AdamW step): the ratio
is the trainer's overhead. MFU is model FLOPs (6 x parameters + causal attention,
per token) at the measured tokens/s over the FLOP/s of a large matmul measured here.

    python -m bench.trainer
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch

from trace_rl.config import Config
from trace_rl.data.sample import TrainingSample
from trace_rl.models.tiny import ARCHITECTURE, build_tokenizer
from trace_rl.storage import RunStorage
from trace_rl.trainer.packing import pack
from trace_rl.trainer.trainer import Trainer, resolve_device, row_call

SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4}
SAMPLES, MIN_LEN, MAX_LEN, MICRO_BATCH_TOKENS = 16, 64, 256, 1024


def build_model(directory: str, dtype: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(**{**ARCHITECTURE, **SHAPE}, vocab_size=64 * ((len(tokenizer) + 63) // 64), dtype=dtype)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def workload(seed: int = 0) -> list[TrainingSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(SAMPLES):
        n = int(rng.integers(MIN_LEN, MAX_LEN))
        completion = np.arange(n) >= n // 2
        samples.append(TrainingSample(
            trace_id=f"bench-{i}", branch_index=0, env="bench", input_ids=rng.integers(0, 256, n).astype(np.int32),
            temperature=1.0, sampled=completion,
            inference_logprobs=np.where(completion, -5.8, 0.0).astype(np.float32),
            rl_values=np.where(completion, rng.normal(0, 1, n), 0).astype(np.float32), rl_mask=completion,
            ce_values=np.zeros(n, np.float32), ce_mask=np.zeros(n, bool),
        ))
    return samples


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocations, kernels, optimizer state
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = best_seconds(lambda: a @ b, device, 10)
    return 2 * n**3 / seconds


def bare_step(model, optimizer, micro_batches, device: torch.device, dtype: torch.dtype) -> None:
    """Forward/backward of each micro-batch under the trainer's autocast (float32 weights, `dtype` compute)."""
    optimizer.zero_grad(set_to_none=True)
    for batch in micro_batches:
        ids = torch.from_numpy(batch.row_ids).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(**row_call(batch, device)).logits
        torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[1:]).backward()
    optimizer.step()


def model_flops_per_token(model, mean_length: float) -> float:
    """6 x parameters (forward + backward matmuls, the tied LM head counted once) + causal attention."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    attention = 6 * c.num_hidden_layers * c.hidden_size * mean_length  # 12 L d T, halved by causality
    return 6 * params + attention


def run(repeats: int = 3) -> dict:
    device = resolve_device("auto")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    samples = workload()
    tokens = sum(len(s) for s in samples)
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-") as tmp:
        model_dir = os.path.join(tmp, "model")
        build_model(model_dir, dtype)
        config = Config(name="bench", storage=os.path.join(tmp, "runs"), env=[{"id": "bench"}],
                        model={"name": model_dir, "dtype": dtype},
                        # unshared: the bare loop runs the same rows (bench.long_prefix measures sharing)
                        trainer={"micro_batch_tokens": MICRO_BATCH_TOKENS, "lr": 1e-5, "share_prefixes": False})
        trainer = Trainer(config, RunStorage.of(config))
        trainer_s = best_seconds(lambda: trainer.optimizer_step(0, samples), device, repeats)
        micro_batches = pack(samples, MICRO_BATCH_TOKENS)
        bare_s = best_seconds(
            lambda: bare_step(trainer.module, trainer.optimizer, micro_batches, device, trainer.dtype), device, repeats)
        flops_per_token = model_flops_per_token(trainer.module, tokens / len(samples))
        params = sum(p.numel() for p in trainer.module.parameters())
    peak = matmul_flops_per_s(device, getattr(torch, dtype))
    return {
        "device": str(device), "dtype": dtype, "parameters": params, "tokens": tokens,
        "micro_batches": len(micro_batches), "threads": torch.get_num_threads(),
        "trainer_seconds": trainer_s, "trainer_tokens_per_s": tokens / trainer_s,
        "bare_seconds": bare_s, "bare_tokens_per_s": tokens / bare_s, "overhead": trainer_s / bare_s - 1,
        "matmul_flops_per_s": peak, "model_flops_per_token": flops_per_token,
        "trainer_mfu": flops_per_token * tokens / trainer_s / peak,
        "bare_mfu": flops_per_token * tokens / bare_s / peak,
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    r = run()
    print(f"{r['device']} {r['dtype']}, {r['threads']} threads, load average {r['load_average']:.2f}: "
          f"{r['parameters'] / 1e6:.1f}M parameters, {r['tokens']:,} tokens in {r['micro_batches']} micro-batches")
    print(f"trainer   {r['trainer_tokens_per_s']:>10,.0f} tokens/s  ({r['trainer_seconds']:.3f} s/step)  "
          f"MFU {r['trainer_mfu']:.1%}")
    print(f"bare loop {r['bare_tokens_per_s']:>10,.0f} tokens/s  ({r['bare_seconds']:.3f} s/step)  "
          f"MFU {r['bare_mfu']:.1%}")
    print(f"trainer overhead vs bare loop: {r['overhead']:+.1%}; matmul {r['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s")


if __name__ == "__main__":
    main()
