"""The sampler-trainer logprob gap per dtype: what the hf sampler records against what the trainer computes.

Both sides hold the same weights: the sampler a `model.dtype` copy (what `weights/<step>/` holds),
the trainer float32 master weights and, in a half dtype, the copy of them in that dtype that it
computes on (`trace_rl.trainer.compute_copy`). The
sampler decodes `--samples` completions of `--tokens` tokens at temperature 1 after random
prompts (KV cache, left-padded batch: the hf sampler's own `decode_batch`); the trainer scores
them as one packed micro-batch (`token_logprobs`). Reported over the sampled tokens: mean and max
|Δlogprob| (the gap the importance ratio sees: exp(Δ) - 1 for a small Δ), per setting:

- float32: both sides float32;
- bfloat16, bfloat16 head: the output layer in bfloat16 on both sides, its logits rounded to
  bfloat16 (trace-rl before the float32 head; vLLM's default);
- bfloat16, float32 head: float32 logits from bfloat16 inputs on both sides
  (`trace_rl.models.float32_head`; vLLM's `head_dtype = float32`), the trainer's
  `output_layer = "float32"`;
- bfloat16, chunked head: the same sampler, the trainer's `output_layer = "chunked"` (the
  default: vocabulary chunks with float32 sums, `trace_rl.models.chunked_head`);
- bfloat16, chunked head, bfloat16 math mode: the same, its float32 GEMMs in oneDNN's bfloat16
  math mode (`trace_rl.models.bfloat16_products`), what a bfloat16 trainer on a CPU runs where
  nothing samples beside it.

    python -m bench.logprob_gap --model smollm2-135m --samples 8 --tokens 24   # make bench's run
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import numpy as np
import torch

from trace_rl.data.sample import TrainingSample
from trace_rl.inference.hf_decode import Request, decode_batch
from trace_rl.models.float32_head import use_float32_head
from trace_rl.models.hub import resolve_model_path
from trace_rl.models.rms_norm import use_one_rounding_norms
from trace_rl.trainer import trainer as trainer_module
from trace_rl.trainer.compute_copy import ComputeCopy
from trace_rl.trainer.packing import MicroBatch, collate
from trace_rl.trainer.varlen import PACKED_ATTENTION

# setting -> (model.dtype, the sampler's float32 head, the trainer's output layer: "bfloat16" is the float32 layer's
# path with its logits rounded to bfloat16)
SETTINGS = {"float32": ("float32", True, "chunked"), "bfloat16, bfloat16 head": ("bfloat16", False, "bfloat16"),
            "bfloat16, float32 head": ("bfloat16", True, "float32"),
            "bfloat16, chunked head": ("bfloat16", True, "chunked"),
            "bfloat16, chunked head, bfloat16 math mode": ("bfloat16", True, "chunked+bf16")}


def half_precision_head(head: torch.nn.Module, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output layer in the compute dtype: logits rounded to it (the 'bfloat16 head' setting)."""
    return head(hidden).float()


def sample(path: str, dtype: torch.dtype, float32_head: bool, prompts: list[list[int]], tokens: int):
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if float32_head:
        use_float32_head(model)
    use_one_rounding_norms(model, dtype)  # as the hf sampler's
    requests = [Request(prompt, temperature=1.0, top_p=1.0, max_tokens=tokens, seed=i)
                for i, prompt in enumerate(prompts)]
    return decode_batch(model, requests, stop_ids=[-1], pad_id=0)


def sampled_batch(prompts: list[list[int]], generations) -> MicroBatch:
    """One micro-batch of the completions, rl on each sampled token, its recorded logprob as `inference_logprobs`."""
    samples = []
    for i, (prompt, generation) in enumerate(zip(prompts, generations)):
        ids = np.array(prompt + generation.token_ids, dtype=np.int32)
        sampled = np.arange(len(ids)) >= len(prompt)
        recorded = np.zeros(len(ids), np.float32)
        recorded[sampled] = generation.logprobs
        zero = np.zeros(len(ids), np.float32)
        samples.append(TrainingSample(
            trace_id=str(i), branch_index=0, env="bench", input_ids=ids, temperature=1.0, sampled=sampled,
            inference_logprobs=recorded, rl_values=zero, rl_mask=sampled, ce_values=zero, ce_mask=np.zeros_like(sampled)))
    return collate(samples, share=True, loss_positions_only=True)


def score(path: str, dtype: torch.dtype, output_layer: str, prompts, generations) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=PACKED_ATTENTION)
    if dtype != torch.float32:
        model = ComputeCopy(model, dtype).module
    batch = sampled_batch(prompts, generations)
    head = contextlib.nullcontext() if output_layer != "bfloat16" else mock.patch.object(
        trainer_module, "float32_logits", half_precision_head)
    with torch.no_grad(), head:
        lp, _ = trainer_module.token_logprobs(model, batch, torch.device("cpu"),
                                              output_layer={"bfloat16": "float32", "chunked+bf16": "chunked"}.get(
                                                  output_layer, output_layer),
                                              bfloat16_gemms=output_layer == "chunked+bf16")
    return (lp.numpy() - batch.inference_logprobs)[batch.rl_mask]


def run(model: str = "smollm2-135m", samples: int = 8, tokens: int = 24, prompt_tokens: int = 16, seed: int = 0) -> dict:
    path = resolve_model_path(model)
    vocab = __import__("transformers").AutoConfig.from_pretrained(path).vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, min(vocab, 256), prompt_tokens).tolist() for _ in range(samples)]
    rows = {}
    for name, (dtype_name, float32_head, output_layer) in SETTINGS.items():
        dtype = getattr(torch, dtype_name)
        started = time.perf_counter()
        generations = sample(path, dtype, float32_head, prompts, tokens)
        gap = np.abs(score(path, dtype, output_layer, prompts, generations))
        rows[name] = {"tokens": int(gap.size), "mean_abs": float(gap.mean()), "max_abs": float(gap.max()),
                      "seconds": time.perf_counter() - started}
    return {"model": model, "vocab": vocab, "samples": samples, "completion_tokens": tokens, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    torch.manual_seed(0)
    result = run(args.model, args.samples, args.tokens)
    print(f"{result['model']} (vocabulary {result['vocab']}), {result['samples']} samples x "
          f"{result['completion_tokens']} tokens, CPU, {torch.get_num_threads()} threads")
    print("| setting | tokens | mean abs Δlogprob | max abs Δlogprob | seconds |\n|---|---|---|---|---|")
    for name, row in result["rows"].items():
        print(f"| {name} | {row['tokens']} | {row['mean_abs']:.2e} | {row['max_abs']:.2e} | {row['seconds']:.1f} |")


if __name__ == "__main__":
    main()
