"""Storage and weight hand-offs: weight broadcast vs a raw safetensors round trip, Parquet MB/s.

Weights: a Qwen2 model built in memory (hidden 512, 8 layers, 8 heads, 4 KV heads, MLP
1536, the tiny byte vocabulary: 25M parameters, 100 MB in fp32). The broadcast is what a
step does after training: `Trainer.export_weights` (HF safetensors + config + tokenizer into
`weights/<step>/`, marked STABLE) then `trace_rl.inference.broadcast.broadcast_weights` into an
hf sampler runtime (staged to local disk first when the run is on S3). The raw baseline
saves the same state dict with `safetensors.torch.save_file` to a local file, loads it with
`load_file` and copies it into the sampler model with `load_state_dict`.

Parquet: a step of 1024 branches of 1024 tokens (bench/algorithms.py's synthetic step,
grpo + echo channels aggregated into 1024 training samples; random token ids and logprobs
per branch, so compression does not flatter the figures), written and read back with
`trace_rl.tables` as traces (`steps/<s>/traces.parquet`) and as a training batch
(`steps/<s>/batch.parquet`). MB/s is over the wall time of the whole call (conversion
to/from Arrow included), for the file's bytes and for the Arrow table's bytes; tokens/s too.
Storage: local disk, and S3 served by moto on loopback.

Best of 5 per weight figure, of 3 per Parquet figure.

    python -m bench.io
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time

SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4}
BUCKET = "trace-rl-bench"


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


@contextlib.contextmanager
def s3_server():
    """moto's S3 server on a free loopback port; yields fsspec storage options for it."""
    import boto3

    from bench.step import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                             region_name="us-east-1").create_bucket(Bucket=BUCKET)
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        yield {"client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}, "key": "bench",
               "secret": "bench"}
    finally:
        proc.terminate()
        proc.wait(10)


def build_model(directory: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trace_rl.models.tiny import ARCHITECTURE, build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(**{**ARCHITECTURE, **SHAPE}, vocab_size=64 * ((len(tokenizer) + 63) // 64))
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def weight_broadcast(tmp: str, storages: dict[str, tuple[str, dict]], repeats: int) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from trace_rl.config import Config
    from trace_rl.inference.broadcast import broadcast_weights
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.tiny import cache_dir
    from trace_rl.pipeline.colocation import runtime_configs
    from trace_rl.storage import RunStorage
    from trace_rl.trainer.trainer import Trainer

    model_dir = os.path.join(tmp, "model")
    build_model(model_dir)
    results: dict = {}
    runtime = None
    for where, (url, options) in storages.items():
        config = Config(name="bench-io-weights", storage=url, storage_options=options, env=[{"id": "bench"}],
                        model={"name": model_dir}, inference={"backend": "hf"})
        storage = RunStorage.of(config)
        trainer = Trainer(config, storage)
        runtime = runtime or build_runtime(runtime_configs(config)["policy"])
        step = iter(range(1, 10**6))

        def broadcast():
            s = next(step)
            trainer.export_weights(s)
            asyncio.run(broadcast_weights(runtime, storage, s))

        results[where] = {"broadcast_seconds": best_seconds(broadcast, repeats)}
        with contextlib.suppress(FileNotFoundError):  # S3 stages weights into the cache; keep it from growing
            import shutil

            shutil.rmtree(cache_dir() / "weights")
    state = {k: v.detach().clone().contiguous() for k, v in trainer.module.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embeddings, saved once as export_weights does
    path = os.path.join(tmp, "raw.safetensors")

    def raw_round_trip():
        save_file(state, path)
        runtime.model.load_state_dict(load_file(path), strict=False)

    raw = best_seconds(raw_round_trip, repeats)
    size = os.path.getsize(path)
    for where in results:
        results[where]["ratio_to_raw"] = results[where]["broadcast_seconds"] / raw
    return {"parameters": sum(p.numel() for p in trainer.module.parameters()), "megabytes": size / 1e6,
            "raw_seconds": raw, "raw_mb_per_s": size / 1e6 / raw, "storages": results,
            "torch_threads": torch.get_num_threads()}


def parquet_throughput(storages: dict[str, tuple[str, dict]], repeats: int) -> dict:
    import numpy as np

    from bench.algorithms import synthetic_step
    from trace_rl.algorithms import load_algorithm
    from trace_rl.algorithms.runner import apply_algorithm
    from trace_rl.pipeline.channels import sum_channels
    from trace_rl.storage import RunStorage
    from trace_rl.tables import read_batch, read_traces, samples_to_table, traces_to_table, write_batch, write_traces

    traces = synthetic_step()
    rng = np.random.default_rng(0)
    for trace in traces:  # distinct tokens and logprobs per branch, so compression does not flatter the figures
        branch = trace.branches[0]
        branch.token_ids = rng.integers(0, 50_000, len(branch)).astype(branch.token_ids.dtype)
        branch.logprobs = np.where(branch.sampled, -rng.random(len(branch)), 0.0).astype(branch.logprobs.dtype)
    channels = [c for algo in (load_algorithm("grpo"), load_algorithm({"id": "echo", "user": {"alpha": 0.5}}))
                for c in asyncio.run(apply_algorithm(algo, traces))]
    samples = sum_channels(traces, channels)
    tables = {"traces": (write_traces, read_traces, traces, traces_to_table(traces).nbytes),
              "batch": (write_batch, read_batch, samples, samples_to_table(samples).nbytes)}
    tokens = sum(len(b) for t in traces for b in t.branches)
    results: dict = {}
    for where, (url, options) in storages.items():
        storage = RunStorage(url, "bench-io-parquet", options)
        for name, (write, read, rows, arrow_bytes) in tables.items():
            write_s = best_seconds(lambda: write(storage, 1, rows), repeats)
            read_s = best_seconds(lambda: read(storage, 1), repeats)
            size = storage.fs.size(storage.step_path(1, f"{name}.parquet"))
            results[f"{where}/{name}"] = {
                "file_mb": size / 1e6, "arrow_mb": arrow_bytes / 1e6, "write_seconds": write_s, "read_seconds": read_s,
                "write_mb_per_s": size / 1e6 / write_s, "read_mb_per_s": size / 1e6 / read_s,
                "write_arrow_mb_per_s": arrow_bytes / 1e6 / write_s, "read_arrow_mb_per_s": arrow_bytes / 1e6 / read_s,
                "write_tokens_per_s": tokens / write_s, "read_tokens_per_s": tokens / read_s,
            }
    return {"tokens": tokens, "rows": {"traces": len(traces), "batch": len(samples)}, "tables": results}


def run(repeats: int = 3, weight_repeats: int = 5) -> dict:
    with tempfile.TemporaryDirectory(prefix="trace-rl-bench-io-") as tmp, s3_server() as s3_options:
        os.environ.setdefault("TRACE_RL_CACHE", os.path.join(tmp, "cache"))
        storages = {"local": (os.path.join(tmp, "runs"), {}), "s3": (f"s3://{BUCKET}/runs", s3_options)}
        return {"weights": weight_broadcast(tmp, storages, weight_repeats),
                "parquet": parquet_throughput(storages, repeats),
                "load_average": os.getloadavg()[0]}


def main() -> None:
    r = run()
    w = r["weights"]
    print(f"weights: {w['parameters'] / 1e6:.1f}M parameters, {w['megabytes']:.0f} MB; load average "
          f"{r['load_average']:.2f}")
    print(f"raw safetensors save + load + load_state_dict: {w['raw_seconds']:.3f} s ({w['raw_mb_per_s']:.0f} MB/s)")
    for where, s in w["storages"].items():
        print(f"broadcast via {where}: {s['broadcast_seconds']:.3f} s ({s['ratio_to_raw']:.2f}x raw)")
    print(f"{'parquet':<14} {'file MB':>8} {'arrow MB':>9} {'write MB/s':>11} {'read MB/s':>10} "
          f"{'write Mtok/s':>13} {'read Mtok/s':>12}")
    for name, t in r["parquet"]["tables"].items():
        print(f"{name:<14} {t['file_mb']:>8.1f} {t['arrow_mb']:>9.1f} {t['write_mb_per_s']:>11.1f} "
              f"{t['read_mb_per_s']:>10.1f} {t['write_tokens_per_s'] / 1e6:>13.2f} "
              f"{t['read_tokens_per_s'] / 1e6:>12.2f}")


if __name__ == "__main__":
    main()
