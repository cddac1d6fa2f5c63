"""Batched sampling with a transformers causal LM: many requests decoded together, each as if alone.

Prompts are left-padded into one batch (attention mask and per-row position ids hide the padding), then
decoded one token per step with the KV cache. Every request keeps its own temperature, top-p, token
budget, stop strings and seeded `torch.Generator`, so what it samples does not depend on the other rows; a
row leaves the batch (and its cache rows are dropped) as soon as it samples a stop token, completes a stop
string (that token is kept, as vLLM keeps it) or reaches its budget.
Rows agree with a one-request batch to float rounding only (CPU GEMM results depend on the row
count), so the same seed gives the same tokens unless a draw falls within ~1e-7 of a boundary.

The recorded logprob of a sampled token is the *processed* one, the quantity the trainer computes:

    logp(x_t) = log_softmax(z_t / T)[x_t] restricted to the top-p nucleus and renormalized,

where the nucleus keeps the most likely tokens whose cumulative probability (ascending order) exceeds
1 - top_p, and always the most likely token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trace_rl.models.runtime import Generation


@dataclass
class Request:
    prompt_ids: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    adapter: bool = True  # a LoRA runtime: sample with its adapter (False: the base model); decoded in separate batches
    stop: tuple[str, ...] = ()  # stop strings, matched on the completion's text without special tokens
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def nucleus_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Row-wise log_softmax(logits / T) over each row's top-p nucleus (-inf outside it); rows with top_p 1 keep all."""
    scaled = logits / temperature[:, None]
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1.0 - top_p)[:, None]
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop & (top_p < 1.0)[:, None], float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of prompts left-padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def completes_stop_string(token_ids: list[int], stop: tuple[str, ...], decode: Callable[[list[int]], str]) -> bool:
    """Whether the text of `token_ids` now holds a stop string. Checked after every token, so a match is one the
    newest token completed: only the tail is decoded, 4 tokens per character (a byte-level vocabulary spells
    a character in at most 4 tokens) and one more."""
    tail = decode(token_ids[-(4 * max(map(len, stop)) + 1):])
    return any(string in tail for string in stop)


@torch.no_grad()
def decode_batch(
    model,
    requests: list[Request],
    *,
    stop_ids: list[int],
    pad_id: int,
    decode: Callable[[list[int]], str] | None = None,
) -> list[Generation]:
    """Sample every request to completion; the generations in request order. `decode` (token ids to text
    without special tokens) is needed by requests with stop strings."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    generators = [torch.Generator(device=device).manual_seed(r.seed) for r in requests]
    temperature = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=device)
    top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=device)
    stops = set(stop_ids)
    live = list(range(len(requests)))  # request index of each batch row
    input_ids, attention_mask = left_padded([r.prompt_ids for r in requests], pad_id, device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    finished: dict[int, str] = {}
    while True:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        logprobs = nucleus_logprobs(logits, temperature, top_p)
        probs = logprobs.exp()
        sampled = torch.cat([torch.multinomial(probs[row], 1, generator=generators[index])
                             for row, index in enumerate(live)])
        chosen = logprobs.gather(-1, sampled[:, None])[:, 0]
        keep = []
        for row, (index, token, logprob) in enumerate(zip(live, sampled.tolist(), chosen.tolist(), strict=True)):
            request = requests[index]
            request.token_ids.append(token)
            request.logprobs.append(logprob)
            if token in stops or (request.stop and completes_stop_string(request.token_ids, request.stop, decode)):
                finished[index] = "stop"  # also at the budget, as in vLLM
            elif len(request.token_ids) >= request.max_tokens:
                finished[index] = "length"
            else:
                keep.append(row)
        if not keep:
            return [Generation(token_ids=r.token_ids, logprobs=r.logprobs, finish_reason=finished[i])
                    for i, r in enumerate(requests)]
        if len(keep) < len(live):
            rows = torch.tensor(keep, device=device)
            cache.batch_select_indices(rows)
            sampled, attention_mask, position_ids = sampled[rows], attention_mask[rows], position_ids[rows]
            temperature, top_p = temperature[rows], top_p[rows]
            live = [live[row] for row in keep]
        input_ids = sampled[:, None]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(live), 1))], dim=1)
        position_ids = position_ids[:, -1:] + 1
