"""Sampler throughput: generated tokens/s of the in-process vLLM engine vs the hf runtime.

Workload (the same for both): the tiny model (fp32, CPU here), `prompts` chat prompts
x `group_size` samples each at temperature 1, `max_tokens` tokens per completion (fewer
when a sample ends at `<|im_end|>`; only generated tokens count), every request submitted
at once as a rollout step does. vLLM batches the concurrent requests continuously; the
hf runtime runs them one after another behind its lock. Start-up (model load, vLLM's
engine processes) is timed apart and excluded from tokens/s; one warm-up request runs first.

    python -m bench.sampler [--prompts 4] [--group-size 4] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from trace_rl.inference.build import build_runtime
from trace_rl.models.runtime import RuntimeConfig, load_tokenizer
from trace_rl.models.tiny import build_tiny


def prompts_for(model_path: str, count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(model_path)
    words = ["hello", "sampler", "benchmark", "reverse", "alphabet", "token", "trace", "policy"]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": f"reverse: {words[i % len(words)]} {i}"}],
                                      add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for i in range(count)
    ]


async def sample_all(runtime, prompts: list[list[int]], group_size: int, max_tokens: int) -> int:
    requests = [runtime.generate(p, temperature=1.0, max_tokens=max_tokens, top_p=1.0, seed=i * group_size + j)
                for i, p in enumerate(prompts) for j in range(group_size)]
    return sum(len(g.token_ids) for g in await asyncio.gather(*requests))


def measure(backend: str, model_path: str, prompts: list[list[int]], group_size: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    runtime = build_runtime(RuntimeConfig(key="policy", name=model_path, backend=backend, cpu_kv_cache_gb=0.5))
    startup = time.perf_counter() - start
    asyncio.run(sample_all(runtime, prompts[:1], 1, 4))
    start = time.perf_counter()
    tokens = asyncio.run(sample_all(runtime, prompts, group_size, max_tokens))
    seconds = time.perf_counter() - start
    return {"startup_s": round(startup, 2), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


def run(prompts: int = 4, group_size: int = 4, max_tokens: int = 48) -> dict:
    model_path = str(build_tiny(0))
    prompt_ids = prompts_for(model_path, prompts)
    results = {backend: measure(backend, model_path, prompt_ids, group_size, max_tokens) for backend in ("vllm", "hf")}
    from trace_rl.inference.vllm_engine import shutdown_engines

    shutdown_engines()
    return {
        "workload": {"model": "tiny", "prompts": prompts, "group_size": group_size, "max_tokens": max_tokens},
        **results,
        "vllm_over_hf": round(results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"], 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    print(json.dumps(run(args.prompts, args.group_size, args.max_tokens), indent=2))
