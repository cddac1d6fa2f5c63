"""The trainer on one CUDA GPU in bfloat16, checked and timed: `make gpu-check` (`python -m bench.gpu_check`).

Model: the realistic fixture (`trace_rl.models.realistic`) at Qwen2.5-0.5B's shape (24 layers, hidden 896,
151,936-token vocabulary, 494M parameters, random weights), built on the machine. Workload: GRPO
groups (`--groups` prompts of `--prompt-tokens` tokens, 8 completions each, of 50-100% of
`--completion-tokens`), rl on the completions, packed as prefix trees (`share_prefixes`) into
micro-batches of `--micro-batch-tokens` distinct positions.

1. Attention: `packed_flex` (one FlexAttention call per layer) against `packed_sdpa` (one padded
   SDPA per layer; on CUDA in bfloat16 `varlen_attn` where a row shares nothing) on prefix trees (a
   branch of a branch whose context ends inside a segment; groups; samples sharing nothing): outputs
   and q/k/v gradients, float32 and bfloat16.
2. Gradients of a small batch: each attention in bfloat16 against a float32 reference
   (`packed_sdpa`, full logits): logprobs max |Δ| and, over all parameters, the cosine and the
   relative norm of the difference. The clip's gradient norm (`gradient_norm`: a half-precision run's, one
   multi-tensor reduction on CUDA) over standard normal gradients of the model's shapes against float64.
3. Timed trainer steps (median of `steps` after two warm-up steps): `packed_sdpa`, `packed_flex`,
   `packed_flex` with its decoder blocks eager (`trainer.compile = false`; on CPU the one compiled
   run), `packed_flex` with the float32 output layer (`trainer.output_layer = "float32"`),
   `packed_flex` with LoRA, `packed_flex` under FSDP2 on one rank; otherwise the defaults (the
   chunked output layer, compile `auto`). Tokens/s counts the distinct positions the model
   computes; MFU = 6 N tokens/s / the device's peak bfloat16 FLOP/s (N: parameters, the tied
   embedding once), and MFU+attn adds prime-rl's attention FLOPs per token (12 x layers x heads x
   head dim x the packed row length); one more step under torch.profiler gives the host time (the
   torch ops' self CPU time) against the GPU time (its kernels'); peak GPU memory per run.
4. The hf sampler in bfloat16 (completions/s, tokens/s) and the sampler-trainer gap: mean and
   max |Δlogprob| of its sampled tokens against the trainer's, with the chunked and with the
   float32 output layer (the sampler's is float32).

It needs CUDA, torch, transformers, peft, safetensors and fsspec, plus pydantic (the config), which
`scripts/gpu_wheels.sh` downloads here into .whl/ and `make gpu-check` installs there first.
`--cpu`: the same checks on the tiny model at toy shapes in float32 on CPU (the FlexAttention
forward only: torch has no FlexAttention backward on CPU), run by the test suite so the check
cannot rot.

Where a step's time goes, op by op and dtype by dtype, against its bfloat16 floor: `python -m bench.bf16_profile
--profile` (not run here: it takes a few minutes more).

    make gpu-check                                           # CUDA: writes bench/RESULTS-gpu.md
    python -m bench.gpu_check --cpu --out /tmp/gpu-check.md  # CPU, toy shapes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from bench.logprob_gap import sampled_batch
from bench.trainer import best_seconds, matmul_flops_per_s, synchronize
from trace_rl.config import Config
from trace_rl.data.sample import TrainingSample
from trace_rl.models.chunked_head import has_float32_out_mm
from trace_rl.storage import RunStorage
from trace_rl.trainer.packing import collate
from trace_rl.trainer.prefix_tree import build_tree
from trace_rl.trainer.trainer import Trainer, gradient_norm, token_logprobs
from trace_rl.trainer.tree_attention import TREE_ATTENTION, packed_flex_attention
from trace_rl.trainer.varlen import PACKED_ATTENTION, packed_sdpa_attention

GROUP_SIZE = 8
# dense bf16 tensor-core FLOP/s (no sparsity) by device name, most specific first
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("GH200", 989.4e12),
             ("A100", 312e12), ("L40S", 362.05e12), ("A10G", 70e12), ("L4", 121e12))
# what passes: max |Δ| / max |packed_sdpa| per attention output and gradient (float32 on CUDA may take TF32), the
# cosine of a small batch's gradient with the float32 reference's, and the clip's gradient norm against float64's
ATTENTION_TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
MIN_GRADIENT_COSINE = {"float32": 0.9999, "bfloat16": 0.99}
GRADIENT_NORM_TOLERANCE = 1e-5
WARMUP_STEPS = 2
SHAPES = {  # per mode: workload and timing
    "cuda": {"groups": 8, "prompt_tokens": 512, "completion_tokens": 512, "micro_batch_tokens": 16384, "steps": 3,
             "samples": 32, "sample_tokens": 128},
    "cpu": {"groups": 2, "prompt_tokens": 16, "completion_tokens": 12, "micro_batch_tokens": 96, "steps": 1,
            "samples": 4, "sample_tokens": 8},
}


def build_model(cuda: bool, cache: str) -> str:
    """CUDA: the realistic fixture at Qwen2.5-0.5B's shape; CPU: the tiny model."""
    if not cuda:
        from trace_rl.models.hub import resolve_model_path

        return resolve_model_path("tiny")
    from trace_rl.models import realistic

    return str(realistic.build_realistic_model(Path(cache), architecture=realistic.QWEN25_05B))


def grpo_samples(groups: int, prompt_tokens: int, completion_tokens: int, vocab: int, seed: int = 0):
    """`groups` prompts x `GROUP_SIZE` completions of 50-100% of `completion_tokens`, rl on the completions."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = rng.integers(0, vocab, prompt_tokens)
        for i in range(GROUP_SIZE):
            completion = rng.integers(0, vocab, int(rng.integers(completion_tokens // 2, completion_tokens + 1)))
            ids = np.concatenate([prompt, completion]).astype(np.int32)
            sampled = np.arange(len(ids)) >= prompt_tokens
            samples.append(TrainingSample(
                trace_id=f"g{g}-{i}", branch_index=0, env="gpu-check", input_ids=ids, temperature=1.0,
                sampled=sampled, inference_logprobs=np.where(sampled, -rng.uniform(4, 8, len(ids)), 0).astype(np.float32),
                rl_values=np.where(sampled, rng.normal(0, 1, len(ids)), 0).astype(np.float32), rl_mask=sampled,
                ce_values=np.zeros(len(ids), np.float32), ce_mask=np.zeros(len(ids), bool)))
    return samples


def trainer_config(model: str, storage: str, dtype: str, attention: str, micro_batch_tokens: int,
                   lora: bool = False, fsdp: bool = False, output_layer: str = "chunked",
                   compile: str | bool = "auto") -> Config:
    return Config(name="gpu-check", storage=storage, env=[{"id": "synthetic"}],
                  model={"name": model, "dtype": dtype, **({"lora": {"rank": 16, "alpha": 32.0}} if lora else {})},
                  inference={"max_model_len": micro_batch_tokens},  # the synthetic samples fit a micro-batch
                  trainer={"lr": 1e-6, "micro_batch_tokens": micro_batch_tokens, "attention": attention,
                           "output_layer": output_layer, "compile": compile, **({"parallel": "fsdp"} if fsdp else {})})


# -- 1. attention ------------------------------------------------------------------------------
def attention_trees(vocab: int):
    """Prefix trees: a branch of a branch (a context ending inside a segment), two groups, samples sharing nothing."""
    rng = np.random.default_rng(1)
    history = rng.integers(0, vocab, 40)
    first = np.concatenate([history, rng.integers(0, vocab, 30)])
    deeper = [first, np.concatenate([history, rng.integers(0, vocab, 25)]),
              np.concatenate([first[:55], rng.integers(0, vocab, 20)])]
    groups = [s.input_ids for s in grpo_samples(2, 30, 20, vocab, seed=2)]
    alone = [rng.integers(0, vocab, n) for n in (17, 33, 9)]
    return {"branch of a branch": build_tree(deeper, share=True), "groups": build_tree(groups, share=True),
            "sharing nothing": build_tree(alone, share=False)}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def check_attention(device: torch.device, vocab: int) -> list[dict]:
    """packed_flex against packed_sdpa on each tree and dtype: output and (on CUDA) q/k/v gradients."""
    rows = []
    backward = device.type == "cuda"
    for dtype in (torch.float32, torch.bfloat16) if backward else (torch.float32,):
        for name, tree in attention_trees(vocab).items():
            torch.manual_seed(0)
            length = len(tree.row_ids)
            base = [torch.randn(1, heads, length, 64, device=device, dtype=dtype) for heads in (14, 2, 2)]
            weights = torch.randn(1, length, 14, 64, device=device, dtype=dtype)
            results = {}
            for attention in (packed_sdpa_attention, packed_flex_attention):
                q, k, v = (x.clone().requires_grad_(backward) for x in base)
                out, _ = attention(None, q, k, v, None, scaling=0.125, row_layout=tree.layout)
                if backward:
                    (out.float() * weights.float()).sum().backward()
                results[attention] = (out.detach(), *((x.grad,) if backward else () for x in (q, k, v)))
            sdpa, flex = results[packed_sdpa_attention], results[packed_flex_attention]
            row = {"tree": name, "dtype": str(dtype).removeprefix("torch."), "tokens": length,
                   "out": relative_error(flex[0], sdpa[0])}
            if backward:
                row.update({part: relative_error(f[0], s[0]) for part, f, s in zip("qkv", flex[1:], sdpa[1:])})
            row["ok"] = all(row[p] <= ATTENTION_TOLERANCE[row["dtype"]] for p in ("out", *"qkv") if p in row)
            rows.append(row)
    return rows


# -- 2. gradients against float32 ------------------------------------------------------------
def logprob_gradients(trainer: Trainer, batch, weights: torch.Tensor, chunk_size) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of the batch and the flat gradient of sum(weights * logprobs) over the trainable parameters of the
    model the trainer computes on (its bfloat16 compute copy in one process), with the trainer's output layer."""
    model = trainer.compute_model
    model.zero_grad(set_to_none=True)
    with trainer._autocast():
        lp, _ = token_logprobs(model, batch, trainer.device, chunk_size, trainer.config.trainer.output_layer)
    (lp * weights).sum().backward()
    grads = [p.grad.double().flatten() for p in model.parameters() if p.grad is not None]
    return lp.detach().float(), torch.cat(grads)


def check_gradients(model: str, storage: str, dtype: str, attentions: list[str], vocab: int) -> list[dict]:
    """Each attention in `dtype` (the chunked output layer, compiled blocks where `auto` compiles them), and the
    last one with the float32 output layer, against float32 packed_sdpa with full logits, eager."""
    batch = collate(grpo_samples(2, 24, 16, vocab, seed=3), share=True, loss_positions_only=True)
    weights = None
    reference = None
    rows = []
    for name, run_dtype, attention, chunk, head, compile_ in [
            ("float32 reference", "float32", PACKED_ATTENTION, None, "float32", False),
            *((a, dtype, a, "auto", "chunked", "auto") for a in attentions),
            (f"{attentions[-1]}, float32 head", dtype, attentions[-1], "auto", "float32", "auto")]:
        config = trainer_config(model, storage, run_dtype, attention, 4096, output_layer=head, compile=compile_)
        trainer = Trainer(config, RunStorage.of(config))
        if weights is None:
            weights = torch.from_numpy(np.random.default_rng(0).normal(size=batch.view_tokens).astype(np.float32))
            weights = weights.to(trainer.device) * torch.from_numpy(batch.rl_mask).to(trainer.device)
        lp, grad = logprob_gradients(trainer, batch, weights, chunk)
        del trainer
        if reference is None:
            reference = (lp, grad)
            continue
        cosine = float(torch.nn.functional.cosine_similarity(grad, reference[1], dim=0))
        rows.append({"run": f"{name}, {dtype}", "logprob_max_abs": float((lp - reference[0]).abs().max()),
                     "grad_cosine": cosine, "ok": cosine >= MIN_GRADIENT_COSINE[dtype],
                     "grad_relative_norm": float((grad - reference[1]).norm() / reference[1].norm())})
    return rows


def check_gradient_norm(model_config, device: torch.device) -> dict:
    """The clip's `gradient_norm` (a half-precision run's) over standard normal gradients of the model's parameter
    shapes, against their float64 norm: its relative error and its best time of 3."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = [p.shape for p in AutoModelForCausalLM.from_config(model_config).parameters()]
    generator = torch.Generator(device).manual_seed(0)
    grads = [torch.randn(shape, device=device, generator=generator) for shape in shapes]
    exact = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    error = abs(float(gradient_norm(grads)) - exact) / exact
    return {"tensors": len(grads), "relative_error": error, "ok": error <= GRADIENT_NORM_TOLERANCE,
            "seconds": best_seconds(lambda: gradient_norm(grads), device, 3)}


# -- 3. timed steps ----------------------------------------------------------------------------
@contextlib.contextmanager
def one_rank_group(cuda: bool):
    """A torch.distributed group of one process (FSDP2 on one rank)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def profiled_step(trainer: Trainer, step: int, samples, cuda: bool) -> tuple[float, float | None]:
    """One more step under torch.profiler: (host seconds: the torch ops' self CPU time summed, GPU seconds: the
    kernels' time summed; None without CUDA)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        trainer.optimizer_step(step, samples)
        synchronize(trainer.device)
    events = prof.events()
    host = sum(event.self_cpu_time_total for event in events) / 1e6
    # the kernels' own events: a CPU op's device time is theirs again
    kernels = sum(event.self_device_time_total for event in events if event.device_type != DeviceType.CPU)
    return host, kernels / 1e6 if cuda else None


def attention_flops_per_token(model_config, sequence: float) -> float:
    """prime-rl's attention FLOPs per token: 12 x layers x heads x head dimension x the packed sequence length (no
    causal discount), beside 6 N."""
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 12 * model_config.num_hidden_layers * heads * head_dim * sequence


def timed_run(config: Config, samples, steps: int, cuda: bool, flops: float) -> dict:
    trainer = Trainer(config, RunStorage.of(config))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, metrics = [], {}
    # the warm-up: compilation (a compiled block's backward graphs may come in the second step), allocations,
    # optimizer state
    for step in range(WARMUP_STEPS + steps):
        synchronize(trainer.device)
        started = time.perf_counter()
        metrics = trainer.optimizer_step(step, samples)
        synchronize(trainer.device)
        seconds.append(time.perf_counter() - started)
    host_seconds, gpu_seconds = profiled_step(trainer, WARMUP_STEPS + steps, samples, cuda)
    parameters = sum(p.numel() for p in trainer.module.parameters())
    result = {"attention": trainer.attention, "dtype": str(trainer.dtype).removeprefix("torch."),
              "output_layer": config.trainer.output_layer, "compiled": trainer.compiled,
              "host_seconds": host_seconds, "gpu_seconds": gpu_seconds,
              "parameters": parameters, "tokens": metrics["tokens"], "sample_tokens": metrics["sample_tokens"],
              "micro_batches": metrics["micro_batches"], "warmup_seconds": sum(seconds[:WARMUP_STEPS]),
              "step_seconds": statistics.median(seconds[WARMUP_STEPS:]),
              "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "finite": math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])}
    result["tokens_per_s"] = result["tokens"] / result["step_seconds"]
    result["mfu"] = 6 * parameters * result["tokens_per_s"] / flops
    sequence = metrics["tokens"] / metrics["micro_batches"]
    result["mfu_attention"] = (6 * parameters + attention_flops_per_token(trainer.module.config, sequence)) \
        * result["tokens_per_s"] / flops
    return result


def timed_runs(model: str, storage: str, dtype: str, cuda: bool, shape: dict, vocab: int,
               flops: float) -> dict[str, dict]:
    """Each run timed on its own; one that fails is reported with its error and the next still runs."""
    samples = grpo_samples(shape["groups"], shape["prompt_tokens"], shape["completion_tokens"], vocab)
    tokens = shape["micro_batch_tokens"]
    flex = TREE_ATTENTION if cuda else "auto"  # on CPU auto is packed_sdpa
    label = TREE_ATTENTION if cuda else PACKED_ATTENTION
    # compile "auto": on CUDA in one process, off on CPU; the CPU run compiles once so the switch cannot rot
    runs = {"packed_sdpa": (trainer_config(model, storage, dtype, PACKED_ATTENTION, tokens), False),
            **({"packed_flex": (trainer_config(model, storage, dtype, flex, tokens), False)} if cuda else {}),
            f"{label}, compile {'off' if cuda else 'on'}": (trainer_config(model, storage, dtype, flex, tokens,
                                                                           compile=not cuda), False),
            f"{label}, float32 head": (trainer_config(model, storage, dtype, flex, tokens, output_layer="float32"),
                                       False),
            "LoRA (rank 16)": (trainer_config(model, storage, dtype, flex, tokens, lora=True), False),
            "FSDP2, one rank": (trainer_config(model, storage, dtype, flex, tokens, fsdp=True), True)}
    results = {}
    for name, (config, distributed) in runs.items():
        started = time.perf_counter()
        try:
            with one_rank_group(cuda) if distributed else contextlib.nullcontext():
                results[name] = timed_run(config, samples, shape["steps"], cuda, flops)
        except Exception as error:  # noqa: BLE001 - the other runs are still worth timing
            traceback.print_exc()
            results[name] = {"error": error_line(error)}
        print(f"[gpu_check] run {name}: {time.perf_counter() - started:.1f} s", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return results


# -- 4. the hf sampler -------------------------------------------------------------------------
def check_sampler(model: str, storage: str, dtype: str, attention: str, shape: dict, vocab: int) -> dict:
    from trace_rl.inference.hf import HFRuntime
    from trace_rl.models.runtime import RuntimeConfig

    runtime = HFRuntime(RuntimeConfig(key="policy", name=model, backend="hf", dtype=dtype))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, vocab, 32).tolist() for _ in range(shape["samples"])]

    async def sample():
        return await asyncio.gather(*(runtime.generate(p, temperature=1.0, max_tokens=shape["sample_tokens"], seed=i)
                                      for i, p in enumerate(prompts)))

    started = time.perf_counter()
    generations = asyncio.run(sample())
    seconds = time.perf_counter() - started
    completion_tokens = sum(len(g.token_ids) for g in generations)
    config = trainer_config(model, storage, dtype, attention, 4096)
    trainer = Trainer(config, RunStorage.of(config))
    batch = sampled_batch(prompts, generations)
    result = {"samples": len(prompts), "completion_tokens": completion_tokens, "seconds": seconds,
              "tokens_per_s": completion_tokens / seconds}
    for head in ("chunked", "float32"):
        with torch.no_grad(), trainer._autocast():
            lp, _ = token_logprobs(trainer.compute_model, batch, trainer.device, output_layer=head)
        gap = np.abs(lp.float().cpu().numpy() - batch.inference_logprobs)[batch.rl_mask]
        result[head] = {"gap_mean": float(gap.mean()), "gap_max": float(gap.max())}
    return result


# -- the report --------------------------------------------------------------------------------
def peak_flops(cuda: bool, override_tflops: float | None) -> tuple[float, str]:
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if cuda:
        name = torch.cuda.get_device_name()
        for key, flops in PEAK_BF16:
            if key in name:
                return flops, f"{name} datasheet, dense bf16"
        raise SystemExit(f"no peak bf16 FLOP/s known for {name!r}; pass --peak-tflops")
    return matmul_flops_per_s(torch.device("cpu"), torch.float32), "measured float32 matmul (CPU)"


def report(result: dict) -> str:
    """The markdown report of what has run so far: a phase not yet run is left out, a failed one shows its error."""
    gb = lambda value: f"{value:.1f}" if value is not None else "-"
    parameters = next((run["parameters"] for run in result.get("runs", {}).values() if "parameters" in run), None)
    shape = result["model_shape"] + (f" ({parameters / 1e6:,.0f}M parameters)" if parameters else "")
    lines = [f"# GPU check: {result['device']}", "",
             f"`{result['command']}`: {shape}, {result['dtype']}, torch {result['torch']}; "
             f"{result['wall_seconds']:.0f} s in all. Peak FLOP/s: {result['flops_source']}. Chunked output layer's "
             f"float32 sums: {result['float32_sums']}.", ""]
    if result["failed"]:
        lines += ["**Failed phases:** " + "; ".join(f"{phase}: `{error}`" for phase, error in result["failed"].items()),
                  ""]
    if "attention" in result:
        lines += ["## Attention: packed_flex against packed_sdpa (max |Δ| / max |packed_sdpa|)", "",
                  f"Within {ATTENTION_TOLERANCE} by dtype: {'all' if all(r['ok'] for r in result['attention']) else 'NOT all'}.", "",
                  "| tree | dtype | tokens | out | dq | dk | dv | ok |", "|---|---|---|---|---|---|---|---|"]
        for row in result["attention"]:
            grads = " | ".join(f"{row[p]:.1e}" if p in row else "-" for p in "qkv")
            lines.append(f"| {row['tree']} | {row['dtype']} | {row['tokens']} | {row['out']:.1e} | {grads} | "
                         f"{'yes' if row['ok'] else 'NO'} |")
        lines.append("")
    if "gradients" in result:
        lines += ["## Gradients of a small batch against float32 packed_sdpa with full logits", "",
                  f"Gradient cosine at least {MIN_GRADIENT_COSINE} by dtype: "
                  f"{'all' if all(r['ok'] for r in result['gradients']) else 'NOT all'}.", "",
                  "| run | logprob max abs Δ | gradient cosine | abs Δgradient norm / gradient norm | ok |",
                  "|---|---|---|---|---|"]
        for row in result["gradients"]:
            lines.append(f"| {row['run']} | {row['logprob_max_abs']:.2e} | {row['grad_cosine']:.6f} | "
                         f"{row['grad_relative_norm']:.2e} | {'yes' if row['ok'] else 'NO'} |")
        lines.append("")
    if "gradient_norm" in result:
        g = result["gradient_norm"]
        lines += ["## The clip's gradient norm", "",
                  f"`gradient_norm` over {g['tensors']} standard normal gradients of the model's shapes: "
                  f"{g['relative_error']:.1e} off their float64 norm (at most {GRADIENT_NORM_TOLERANCE:.0e}: "
                  f"{'yes' if g['ok'] else 'NO'}), in {g['seconds'] * 1e3:.1f} ms.", ""]
    if "runs" in result:
        seconds = lambda value: f"{value:.3f}" if value is not None else "-"
        lines += [f"## Trainer steps (median of {result['steps']} after {WARMUP_STEPS} warm-up steps)", "",
                  "MFU: 6 N tokens/s over the peak; MFU+attn adds prime-rl's attention FLOPs (12 x layers x heads x "
                  "head dim x the packed row length per token). Host s: the torch ops' self CPU time of one more "
                  "step under torch.profiler; GPU s: its kernels' time (the GPU idles for the rest of the step).", "",
                  "| run | attention | head | compiled | tokens / step (samples' tokens) | micro-batches | step s | "
                  "warm-up s | host s | GPU s | tokens/s | MFU | MFU+attn | peak GPU GB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, run in result["runs"].items():
            if "error" in run:
                lines.append(f"| {name} | failed: `{run['error']}` |" + "  |" * 12)
                continue
            compiled = "yes" if run["compiled"] else "no"
            lines.append(f"| {name} | {run['attention']} | {run['output_layer']} | {compiled} | "
                         f"{run['tokens']:,.0f} ({run['sample_tokens']:,.0f}) | "
                         f"{run['micro_batches']:.0f} | {run['step_seconds']:.3f} | {run['warmup_seconds']:.1f} | "
                         f"{seconds(run['host_seconds'])} | {seconds(run['gpu_seconds'])} | "
                         f"{run['tokens_per_s']:,.0f} | {run['mfu']:.1%} | {run['mfu_attention']:.1%} | "
                         f"{gb(run['peak_gb'])} |")
        lines.append("")
    if "sampler" in result:
        s = result["sampler"]
        lines += ["## The hf sampler", "",
                  f"{s['samples']} completions, {s['completion_tokens']} tokens in {s['seconds']:.1f} s "
                  f"({s['tokens_per_s']:,.0f} tokens/s). Sampler-trainer gap over the sampled tokens (the sampler's "
                  "float32 output layer against the trainer's): "
                  + "; ".join(f"{head} head mean |Δlogprob| {s[head]['gap_mean']:.2e}, max {s[head]['gap_max']:.2e}"
                              for head in ("chunked", "float32")) + ".", ""]
    return "\n".join(lines)


def error_line(error: BaseException) -> str:
    """An exception as one line: its type, message and the innermost frame of this project's code."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "trace_rl" in f.filename or "bench" in f.filename]
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}{where}"[:400]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="toy shapes, float32, on CPU (the test suite's run)")
    parser.add_argument("--model", help="a model directory (default: the realistic fixture, built here)")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "trace-rl-gpu-check-models"))
    parser.add_argument("--peak-tflops", type=float, help="the device's peak bf16 TFLOP/s, if not known by name")
    parser.add_argument("--out", help="the markdown report (default on CUDA: bench/RESULTS-gpu.md)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device here; --cpu runs the toy check on CPU")
    started = time.perf_counter()
    shape = SHAPES["cuda" if cuda else "cpu"]
    dtype = "bfloat16" if cuda else "float32"
    device = torch.device("cuda" if cuda else "cpu")
    model = args.model or build_model(cuda, args.cache)
    print(f"[gpu_check] model {model}: {time.perf_counter() - started:.1f} s", flush=True)
    from transformers import AutoConfig, AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))  # the ids the tokenizer has (the embedding has more rows)
    model_config = AutoConfig.from_pretrained(model)
    flops, flops_source = peak_flops(cuda, args.peak_tflops)
    out = args.out or ("bench/RESULTS-gpu.md" if cuda else None)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "CPU (no CUDA)", "torch": torch.__version__,
        "command": "python -m bench.gpu_check " + " ".join(argv), "dtype": dtype, "steps": shape["steps"],
        "model_shape": f"{model_config.num_hidden_layers} layers, hidden {model_config.hidden_size}, vocabulary "
                       f"{model_config.vocab_size}", "flops_source": flops_source, "failed": {},
        "float32_sums": "torch.mm(out_dtype=torch.float32)" if has_float32_out_mm(device.type)
                        else "float32 GEMMs of the rounded inputs (no half-precision GEMM with float32 output here)",
    }

    def record(phase: str, run) -> None:
        """Run one phase; a failure is reported and the next phase still runs. The report is rewritten after each,
        so a check stopped by a time limit keeps what it measured."""
        phase_started = time.perf_counter()
        try:
            result[phase] = run()
        except Exception as error:  # noqa: BLE001 - a device check reports every phase it can
            traceback.print_exc()
            result["failed"][phase] = error_line(error)
        print(f"[gpu_check] {phase}: {time.perf_counter() - phase_started:.1f} s", flush=True)
        result["wall_seconds"] = time.perf_counter() - started
        if out:
            Path(out).write_text(report(result))

    with tempfile.TemporaryDirectory(prefix="trace-rl-gpu-check-") as storage:
        record("attention", lambda: check_attention(device, vocab))
        record("gradients", lambda: check_gradients(model, storage, dtype, [PACKED_ATTENTION, TREE_ATTENTION] if cuda
                                                    else [PACKED_ATTENTION], vocab))
        record("gradient_norm", lambda: check_gradient_norm(model_config, device))
        record("runs", lambda: timed_runs(model, storage, dtype, cuda, shape, vocab, flops))
        if any("error" in run for run in result.get("runs", {}).values()):
            result["failed"]["runs"] = "; ".join(f"{name}: {run['error']}" for name, run in result["runs"].items()
                                                 if "error" in run)
        record("sampler", lambda: check_sampler(model, storage, dtype, TREE_ATTENTION if cuda else "auto", shape,
                                                vocab))
    result["attention_ok"] = all(row["ok"] for row in result.get("attention", []))
    result["gradients_ok"] = all(row["ok"] for row in result.get("gradients", []))
    result["gradient_norm_ok"] = result.get("gradient_norm", {}).get("ok", False)
    result["wall_seconds"] = time.perf_counter() - started
    text = report(result)
    if out:
        Path(out).write_text(text)
    print(text)
    if result["failed"] or not (result["attention_ok"] and result["gradients_ok"] and result["gradient_norm_ok"]):
        raise SystemExit(f"gpu check: a check failed (see {out or 'the report above'})")
    return result


if __name__ == "__main__":
    main()
