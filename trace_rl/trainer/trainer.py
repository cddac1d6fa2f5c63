"""The trainer: one optimizer step per training step over packed micro-batches.

Works in one process or as one rank of a `torch.distributed` job (DDP or FSDP2),
on CPU or CUDA: the device comes from `trainer.device`. Parameters, gradients and
optimizer state are always float32 (the master weights); `model.dtype` bfloat16 or
float16 runs the forward and backward in that dtype, on a copy of the weights cast once
per step in one process (`trace_rl.trainer.compute_copy`), on FSDP2's half-precision
blocks, or under `torch.autocast` with DDP; the exported weights are cast to it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint as recompute_in_backward

from trace_rl.config import Config, ConfigError, LossConfig
from trace_rl.data.sample import TrainingSample
from trace_rl.imports import import_modules
from trace_rl.losses import resolve_loss
from trace_rl.machine.freed_memory import keep_freed_memory
from trace_rl.models.hub import resolve_model_path
from trace_rl.names import LOSS_NAMES
from trace_rl.storage import RunStorage, step_name
from trace_rl.trainer import checkpoint
from trace_rl.trainer.loss import compute_loss
from trace_rl.trainer.packing import CHANNEL_FIELDS, MicroBatch, assign_to_ranks, pack
from trace_rl.models.chunked_head import LOGITS_PER_CHUNK, chunked_logprobs
from trace_rl.models.dtype import resolved_dtype
from trace_rl.models.float32_head import compute_dtype, float32_logits
from trace_rl.models.rms_norm import use_one_rounding_norms
from trace_rl.trainer.attention import PACKED_ATTENTIONS, choose_attention
from trace_rl.trainer.compute_copy import ComputeCopy

logger = logging.getLogger(__name__)
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """`auto` is CUDA when available; a distributed rank uses the GPU of its local rank."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def mixed_precision(dtype: torch.dtype):
    """FSDP2's policy for a half-precision `model.dtype`: each block's parameters are all-gathered and computed
    in `dtype` (half the gather traffic and memory of float32), gradients are reduce-scattered in float32 into
    the float32 master shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def warmup_factor(warmup_steps: int):
    """LR multiplier: linear from 1/warmup_steps to 1 over the first `warmup_steps` steps, then 1."""
    return lambda index: min(1.0, (index + 1) / warmup_steps) if warmup_steps else 1.0


def chunk_positions(vocab_size: int, device_type: str = "cpu") -> int:
    """Positions per output-layer chunk on a `device_type` device: `LOGITS_PER_CHUNK[device_type] // vocab_size`
    (110 on a CPU and 3,533 on CUDA at Qwen's 151,936 tokens; other devices take the CPU's)."""
    return max(1, LOGITS_PER_CHUNK.get(device_type, LOGITS_PER_CHUNK["cpu"]) // vocab_size)


def choose_compile(setting: str | bool, device_type: str, distributed: bool) -> tuple[bool, str]:
    """Whether the trainer compiles its decoder blocks for `trainer.compile = setting`, and why."""
    if setting != "auto":
        return bool(setting), "trainer.compile says so"
    if device_type != "cuda":
        return False, f"auto on {device_type}: compiling the blocks does not pay there"
    if distributed:
        return False, "auto with several processes: DDP and FSDP2 run their blocks eagerly unless compile = true"
    return True, "auto on CUDA: fewer kernel launches per block"


def compile_blocks(module: torch.nn.Module) -> None:
    """`torch.compile` each decoder block of a Hugging Face model in place (its `_no_split_modules` types), dynamic
    in the row length: every micro-batch has its own."""
    block_names = set(getattr(module, "_no_split_modules", None) or [])
    for sub in module.modules():
        if type(sub).__name__ in block_names:
            sub.compile(dynamic=True)


def takes_bfloat16_gemms(config: Config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the chunked output layer's float32 GEMMs of bfloat16 values run in oneDNN's bfloat16 math mode: for a
    bfloat16 trainer on a CPU, where nothing samples beside training in its process (the mode is the process's,
    `trace_rl.models.bfloat16_products`, and a sampler's float32 matmuls would be rounded): in its own worker
    processes (`trainer.uses_workers`), or with `[async] max_off_policy_steps = 0`."""
    return device.type == "cpu" and dtype == torch.bfloat16 and (
        config.trainer.uses_workers or config.async_.max_off_policy_steps == 0)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (FSDP2's `fully_shard` keeps the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def logits_to_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target at its temperature (with grad) and the entropy there (without).

        logp = log_softmax(logits / T),   lp = logp[target],   entropy = -sum_v exp(logp_v) * logp_v
    """
    logp = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -torch.linalg.vecdot(logp.exp(), logp)
    return lp, entropy


def head_logprobs(
    hf_model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits_to_logprobs` of the output layer (lm_head in float32 from inputs in the compute dtype,
    `float32_logits`; then the final soft-cap of models that have one)."""
    head = hf_model.get_output_embeddings()
    logits = float32_logits(head, hidden, compute_dtype(hidden.device, head.weight.dtype))
    cap = getattr(hf_model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits_to_logprobs(logits, targets, temperature)


def row_call(batch: MicroBatch, device: torch.device) -> dict:
    """The model-call arguments of one packed row: its tokens, position ids and segments (`row_layout`, read by
    the packed attentions), no dense mask."""
    return {"input_ids": torch.from_numpy(batch.row_ids).to(device)[None],
            "position_ids": torch.from_numpy(batch.row_positions).to(device)[None], "attention_mask": None,
            "use_cache": False, "row_layout": batch.layout}


def check_attention(model: torch.nn.Module, batch: MicroBatch) -> None:
    """A row with shared prefixes needs one of `PACKED_ATTENTIONS`: another attention cannot read the segments'
    contexts. (A row of whole samples side by side works with any: transformers builds the block mask from the
    position ids.)"""
    attention = unwrapped(model).config._attn_implementation
    if batch.layout.shares and attention not in PACKED_ATTENTIONS:
        raise ValueError(f"a micro-batch with shared prefixes needs one of the {PACKED_ATTENTIONS} attentions; the "
                         f"model uses {attention!r} (pack with share_prefixes=False for it)")


def final_hidden_states(model: torch.nn.Module, batch: MicroBatch, device: torch.device) -> torch.Tensor:
    """The decoder body's output (T, hidden) of one packed row, taken by a forward hook during the model's call.

    The model is called as a whole, through any DDP/FSDP wrapper (so their forward hooks
    unshard and track the parameters as usual), with `logits_to_keep` empty: its own
    lm_head then runs on no position and no full-vocabulary tensor is made.
    """
    hf_model = unwrapped(model)
    captured: list[torch.Tensor] = []

    def keep_output(module, args, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    hook = hf_model.get_decoder().register_forward_hook(keep_output)
    try:
        extra = {}
        if "logits_to_keep" in inspect.signature(hf_model.forward).parameters:
            extra["logits_to_keep"] = torch.zeros(0, dtype=torch.long, device=device)
        model(**row_call(batch, device), **extra)
    finally:
        hook.remove()
    return captured[-1].squeeze(0)  # not [0]: its backward would write into a zeroed copy of the batch


def rows_logprobs(hf_model: torch.nn.Module, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                  temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_logprobs` of the hidden states at `rows`."""
    return head_logprobs(hf_model, hidden.index_select(0, rows), targets, temperature)


def token_logprobs(
    model: torch.nn.Module, batch: MicroBatch, device: torch.device, chunk_size: int | str | None = "auto",
    output_layer: str = "chunked", bfloat16_gemms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs (with grad) and entropies (without) of a packed micro-batch, in its samples' view.

    The output layer runs on the batch's queries only: query q takes the logits at row position
    `query_source[q]` divided by `query_temperature[q]` (the sample's temperature on a sampled
    token, 1 on any other: prompt, observation) at `query_target[q]`. Each view token gets its
    query's values (`view_query`); a token without one (a sample's first, or one no loss reads)
    gets 0.

    `output_layer` ([trainer] output_layer): `chunked` runs it over vocabulary chunks in the compute dtype with
    float32 sums and an online logsumexp (`trace_rl.models.chunked_head`; a head other than a bias-free Linear,
    an adapted one, takes the float32 head); `float32` runs the float32 head (`float32_logits`) and log-softmax
    over `chunk_size` queries at a time (`"auto"`: `chunk_positions(vocabulary, device.type)`), each chunk
    recomputed in backward. Either way only one chunk's full-vocabulary tensors exist at a time.
    `chunk_size=None` takes the model's full logits instead (the same numbers within float
    rounding; for comparison only: it keeps (tokens x vocabulary) float32 tensors for backward).
    `bfloat16_gemms`: the chunked layer's float32 GEMMs of bfloat16 values run in oneDNN's bfloat16 math mode on a
    CPU (`chunked_logprobs`); only where nothing else in the process runs beside.
    """
    check_attention(model, batch)
    source = torch.from_numpy(batch.query_source).to(device)
    targets = torch.from_numpy(batch.query_target).to(device)
    temperature = torch.from_numpy(batch.query_temperature).to(device)
    hf_model = unwrapped(model)
    head = hf_model.get_output_embeddings()
    if chunk_size is None:
        logits = model(**row_call(batch, device)).logits[0]
        lp, entropy = logits_to_logprobs(logits[source], targets, temperature)
    elif output_layer == "chunked" and type(head) is torch.nn.Linear and head.bias is None:
        hidden = final_hidden_states(model, batch, device)
        dtype = compute_dtype(device, head.weight.dtype)
        lp, entropy = chunked_logprobs(hidden.index_select(0, source).to(dtype), head.weight.to(dtype), targets,
                                       temperature, getattr(hf_model.config, "final_logit_softcapping", None),
                                       bfloat16_gemms=bfloat16_gemms)
    else:
        hidden = final_hidden_states(model, batch, device)
        if chunk_size == "auto":
            chunk_size = chunk_positions(head.weight.shape[0], device.type)
        parts = []
        # a row without queries (a rank without work) still runs one empty chunk: its backward stays in the graph
        for start in range(0, max(len(targets), 1), chunk_size):
            chunk = (hidden, source[start:start + chunk_size], targets[start:start + chunk_size],
                     temperature[start:start + chunk_size])
            if torch.is_grad_enabled() and hidden.requires_grad:
                parts.append(recompute_in_backward(
                    rows_logprobs, hf_model, *chunk, use_reentrant=False, preserve_rng_state=False))
            else:
                parts.append(rows_logprobs(hf_model, *chunk))
        lp, entropy = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    # index 0 is the 0 of tokens without a query; a token read by several samples' views adds their gradients
    at = torch.from_numpy(batch.view_query).to(device) + 1
    zero = lp.new_zeros(1)
    return torch.cat([zero, lp])[at], torch.cat([zero, entropy])[at]


def sequences_with(batch: MicroBatch, mask: np.ndarray) -> int:
    """How many of the micro-batch's samples have a token in `mask`."""
    return len(np.unique(batch.segment_ids[mask]))


def combine(name: str, total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """Add a micro-batch's metric to the step's: a `_min` / `_max` metric keeps the extreme, the others add up."""
    if total is None:
        return value
    if name.endswith("_min"):
        return torch.minimum(total, value)
    if name.endswith("_max"):
        return torch.maximum(total, value)
    return total + value


def resolved_loss_config(config: Config) -> LossConfig:
    """`[trainer.loss]` with `norm_tokens` set where seq-mean-token-sum-norm needs it and left it unset: the
    largest `max_completion_tokens` of the run's sampling ([sampling] and every [env.sampling]). The config's
    `imports` are imported first: a loss of theirs is registered in every process that trains (torchrun ranks
    too)."""
    problems = import_modules(config.imports)
    if problems:
        raise ConfigError(problems)
    loss = config.trainer.loss
    if resolve_loss(loss)[2] != "seq-mean-token-sum-norm" or loss.norm_tokens is not None:
        return loss
    largest = max(config.sampling_for(env).max_completion_tokens for env in config.env)
    return loss.model_copy(update={"norm_tokens": largest})


def set_config_dtype(path: str, dtype: torch.dtype) -> None:
    """Make a saved config.json name the weights' dtype (`save_pretrained` writes the float32 module's)."""
    with open(path) as f:
        config = json.load(f)
    config["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in config:  # the key's name before transformers 5
        config["torch_dtype"] = config["dtype"]
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


NORM_PIECE = 1 << 18


def clip_in_fused_adamw(optimizer: torch.optim.Optimizer, parameters, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a fused AdamW's next step, without its pass over the gradients: the
    gradients' total norm (`gradient_norm`), and the optimizer's `grad_scale` (which its kernel divides each gradient
    by as it reads it) set to 1 / clip_grad_norm_'s coefficient, (norm + 1e-6) / max_norm where that is above 1."""
    norm = gradient_norm([p.grad for p in parameters if p.grad is not None])
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    return norm


def gradient_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all the gradients together, as float32.

    On CPU: the square root of the dot products (BLAS) of each gradient's pieces of `NORM_PIECE` values with
    themselves, summed in float64. Over SmolLM2-135M-shaped gradients on a Zen 5 it is 1.8e-7 off a float64 sum in
    14 ms, where one dot product per gradient was 4.3e-5 off in 11 ms (that CPU's BLAS sums a long vector less
    exactly; 5e-6 off on the AMX Xeon, in 23 ms against `torch.nn.utils.get_total_norm`'s 52, run 11 of
    bench/RESULTS-bf16.md). Elsewhere (CUDA): `get_total_norm`'s multi-tensor kernels, a few launches for all the
    gradients where the pieces would take one each (about 2,100 for Qwen2.5-0.5B)."""
    if not grads:
        return torch.zeros(())
    if grads[0].device.type != "cpu":
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    squares = [torch.dot(piece, piece) for g in grads for piece in g.reshape(-1).split(NORM_PIECE)]
    return torch.stack(squares).double().sum().sqrt().float()


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is NaN or infinite: the step stops before the optimizer changes anything."""


def check_finite(step: int, losses: list[dict[str, float]], grad_norm: float, rank: int) -> None:
    """Raise naming the step, the first micro-batch (of this rank) and the channel (loss name) whose loss is not
    finite, else a bad gradient norm. `losses` holds each micro-batch's loss per channel."""
    for index, per_channel in enumerate(losses):
        for channel, value in per_channel.items():
            if not math.isfinite(value):
                raise NonFiniteError(
                    f"step {step}: the {channel!r} channel's loss of micro-batch {index} (of {len(losses)} on rank "
                    f"{rank}) is {value}; nothing was saved"
                )
    if not math.isfinite(grad_norm):
        raise NonFiniteError(
            f"step {step}: the gradient norm is {grad_norm} although the losses of all {len(losses)} micro-batches "
            f"on rank {rank} are finite (a non-finite gradient in backward, or a loss on another rank); "
            "nothing was saved"
        )


class Trainer:
    """The policy, its optimizer and LR schedule; one rank of a distributed job when a process group exists."""

    def __init__(self, config: Config, storage: RunStorage):
        self.config = config
        self.storage = storage
        self.loss_config = resolved_loss_config(config)  # before the model loads: a bad loss fails at once
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = resolve_device(config.trainer.device, int(os.environ.get("LOCAL_RANK", 0)))
        if self.device.type == "cpu":  # a CPU step's tensors come from malloc: no page faults for the same memory
            why = keep_freed_memory()
            if self.rank == 0:
                logger.info("trainer memory: %s", why)
        torch.manual_seed(config.seed)

        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_path(config.model.name, config.model.revision)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # float32 master weights whatever model.dtype says: an AdamW update of lr ~1e-5 is below half a
        # bfloat16 ulp of most weights and would round away; model.dtype is the compute and export dtype
        self.dtype = getattr(torch, resolved_dtype(config.model.dtype, self.device.type == "cuda", "trainer"))
        self.attention, why = choose_attention(config.trainer.attention, self.device.type)
        if self.rank == 0:
            logger.info("trainer attention: %s (%s)", self.attention, why)
        self.module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=self.attention)
        self.peft = None
        if config.model.lora is not None:
            from peft import get_peft_model

            from trace_rl.models.lora import peft_config

            # peft injects the LoRA layers into the transformers model in place and freezes the rest; the trainer
            # keeps calling that model itself (its decoder and output layer, as without LoRA)
            self.peft = get_peft_model(self.module, peft_config(config.model.lora))
            self.module = self.peft.get_base_model()
        if not config.trainer.cpu_offload:  # offloaded shards stay in CPU memory: the whole model never goes to the GPU
            self.module.to(self.device)
        self.module.config.use_cache = False
        if config.trainer.activation_checkpointing:
            # non-reentrant: works under DDP and FSDP2 and with inputs that need no gradient (token ids)
            self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.module.train()
        self.compiled, why = choose_compile(config.trainer.compile, self.device.type, self.distributed)
        if self.rank == 0:
            logger.info("trainer compile: %s (%s)", self.compiled, why)
        if self.distributed and config.trainer.parallel == "fsdp":  # norms as one process's compute copy has them
            use_one_rounding_norms(self.module, self.dtype)
        if self.compiled and self.distributed:  # before FSDP2 wraps the blocks, as torchtitan does
            compile_blocks(self.module)
        self.model = self._parallelize(self.module)
        # FSDP2 computes in the half dtype itself (mixed_precision); DDP syncs the master's gradients: autocast
        self.compute = ComputeCopy(self.module, self.dtype) if self.dtype != torch.float32 and not self.distributed \
            else None
        if self.compiled and not self.distributed:
            compile_blocks(unwrapped(self.compute_model))

        t = config.trainer
        # a compute copy's step fuses AdamW into one pass per parameter: on a 2-core AMX Xeon an AdamW step over
        # SmolLM2-135M's 135M float32 parameters took 1.2 s against the for-loop's 2.5 s, a quarter of the demo's
        # bfloat16 trainer step (bench/RESULTS-bf16.md). float32 runs keep the for-loop AdamW and clipping, their
        # weights bit for bit what they were.
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=t.lr, betas=t.betas,
            weight_decay=t.weight_decay, fused=True if self.compute is not None else None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_factor(t.warmup_steps))
        # a checkpoint written in the background reads the live parameters and AdamW state: the next step waits for it
        self.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: checkpoint.WRITER.wait())
        if self.compute is not None:  # the fused AdamW's writes, made known to the compute copy's `refresh`
            self.optimizer.register_step_post_hook(
                lambda optimizer, args, kwargs: increment_version(
                    [p for group in optimizer.param_groups for p in group["params"]]))
        self.step: int | None = None
        self.logprob_chunk: int | str | None = "auto"  # None: full logits (bench/memory.py's "before")
        self.bfloat16_gemms = takes_bfloat16_gemms(config, self.device, self.dtype)

    @property
    def compute_model(self) -> torch.nn.Module:
        """The model the forward and backward run on: the compute copy where there is one, else `model`."""
        return self.model if self.compute is None else self.compute.module

    def _parallelize(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed:
            return module
        if self.config.trainer.parallel == "ddp":
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(module, device_ids=device_ids)
        from torch.distributed.fsdp import fully_shard

        policy = {"mp_policy": mixed_precision(self.dtype)} if self.dtype != torch.float32 else {}
        if self.config.trainer.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            policy["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        block_names = set(getattr(module, "_no_split_modules", None) or [])
        for sub in module.modules():
            if type(sub).__name__ in block_names:
                fully_shard(sub, **policy)
        return fully_shard(module, **policy)

    def _gradient_sync(self, enabled: bool):
        """Sync gradients across ranks only on the last micro-batch of a step."""
        if not self.distributed:
            return contextlib.nullcontext()
        if self.config.trainer.parallel == "ddp":
            return contextlib.nullcontext() if enabled else self.model.no_sync()
        # offloaded: every micro-batch's gradients go to CPU memory and add up there; skipping the sync would
        # accumulate unsharded gradients of the whole model on the GPU instead
        self.model.set_requires_gradient_sync(enabled or self.config.trainer.cpu_offload)
        return contextlib.nullcontext()

    def _autocast(self):
        """Forward (and so backward) in `model.dtype` on float32 parameters (DDP; under FSDP2 its blocks' parameters
        are in `model.dtype` already); nothing to do in float32 and on the compute copy.

        No gradient scaler for float16: gradients too small for float16 (below ~6e-8) flush
        to zero. bfloat16 has float32's range and is the dtype to use where the GPU has it.
        """
        enabled = self.dtype != torch.float32 and self.compute is None
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=enabled)

    def _all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(values)
        return values

    def _all_reduce_metrics(self, names: list[str], totals: dict[str, torch.Tensor]) -> list[float]:
        """Each metric over the ranks: summed, but a `_min` / `_max` one reduced by its extreme (0 where no rank
        saw a value: no rl token in the step)."""
        sign = torch.tensor([-1.0 if n.endswith("_min") else 1.0 for n in names], dtype=torch.float64,
                            device=self.device)
        extreme = torch.tensor([n.endswith(("_min", "_max")) for n in names], device=self.device)
        values = torch.stack([totals[n] for n in names])
        summed = self._all_reduce(torch.where(extreme, 0.0, values))
        largest = torch.where(extreme, values * sign, -math.inf)
        if self.distributed:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        reduced = torch.where(extreme, largest * sign, summed)
        return torch.where(torch.isinf(reduced) & extreme, 0.0, reduced).tolist()

    # -- training ---------------------------------------------------------------------
    @property
    def loss_names(self) -> tuple[str, ...]:
        """The loss terms, each logged as `loss/<name>`: the channels, and `kl` with [trainer.loss.kl]."""
        return (*LOSS_NAMES, "kl") if self.loss_config.kl is not None else LOSS_NAMES

    def _reference_logprobs(self, step: int, batch: MicroBatch) -> torch.Tensor | None:
        """The KL reference's logprobs of the micro-batch's tokens (None without [trainer.loss.kl]); a padding
        micro-batch (no masked token) gets zeros, a batch written without the column fails naming the step."""
        if self.loss_config.kl is None:
            return None
        if batch.ref_logprobs is not None:
            return torch.from_numpy(batch.ref_logprobs).to(self.device)
        if batch.rl_mask.any():
            raise ValueError(f"step {step}: [trainer.loss.kl] needs the reference's logprobs, but the batch has no "
                             "ref_logprobs column (written without [trainer.loss.kl]: write the batch again)")
        return torch.zeros(batch.view_tokens, dtype=torch.float32, device=self.device)

    def optimizer_step(self, step: int, samples: list[TrainingSample]) -> dict[str, float]:
        """Pack the samples, accumulate the gradient over this rank's micro-batches, clip, and step."""
        t = self.config.trainer
        micro_batches = pack(samples, t.micro_batch_tokens, t.truncate, t.share_prefixes)
        mine = assign_to_ranks(micro_batches, self.world_size)[self.rank]
        counts = self._all_reduce(
            torch.tensor(
                [[b.rl_mask.sum(), b.ce_mask.sum(), (b.rl_mask | b.ce_mask).sum(), sequences_with(b, b.rl_mask),
                  sequences_with(b, b.ce_mask)] for b in mine],
                dtype=torch.float64, device=self.device,
            ).sum(0)
        )
        rl_tokens, ce_tokens, loss_tokens, rl_sequences, ce_sequences = counts.tolist()
        scales = {"rl": rl_tokens, "ce": ce_tokens, "rl_sequences": rl_sequences, "ce_sequences": ce_sequences}

        self.optimizer.zero_grad(set_to_none=True)
        if self.compute is not None:
            self.compute.refresh()
        totals: dict[str, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        for i, batch in enumerate(mine):
            with self._gradient_sync(i == len(mine) - 1):
                with self._autocast():
                    lp, entropy = token_logprobs(self.compute_model, batch, self.device, self.logprob_chunk,
                                                 t.output_layer, self.bfloat16_gemms)
                on_device = {name: torch.from_numpy(getattr(batch, name)).to(self.device) for name in CHANNEL_FIELDS}
                loss, metrics = compute_loss(
                    lp, on_device["inference_logprobs"],
                    {loss: (on_device[f"{loss}_values"], on_device[f"{loss}_mask"]) for loss in LOSS_NAMES},
                    scales, self.loss_config, sequence_lengths=np.bincount(batch.segment_ids).tolist(),
                    lp_ref=self._reference_logprobs(step, batch),
                )
                # DDP and FSDP average gradients over ranks; the scales already sum over ranks
                (loss * self.world_size).backward()
            if self.compute is not None:
                self.compute.add_gradients()
            losses.append(torch.stack([metrics[f"loss/{name}"] for name in self.loss_names]))
            loss_mask = on_device["rl_mask"] | on_device["ce_mask"]
            metrics["entropy"] = (entropy * loss_mask).sum() / max(loss_tokens, 1.0)
            for name, value in metrics.items():
                totals[name] = combine(name, totals.get(name), value.double())
        names = sorted(totals)
        reduced = self._all_reduce_metrics(names, totals)

        if self.compute is not None:
            grad_norm = clip_in_fused_adamw(self.optimizer, self.model.parameters(), t.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        check_finite(step, [dict(zip(self.loss_names, values)) for values in torch.stack(losses).tolist()],
                     float(grad_norm), self.rank)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step = step
        result = dict(zip(names, reduced))
        result["loss"] = sum(result[f"loss/{name}"] for name in self.loss_names)
        result.update(
            grad_norm=float(grad_norm), lr=lr, tokens=float(sum(b.num_tokens for b in micro_batches)),
            sample_tokens=float(sum(b.view_tokens for b in micro_batches)),
            output_positions=float(sum(len(b.query_source) for b in micro_batches)),
            micro_batches=float(len(micro_batches)), samples=float(len(samples)),
        )
        return result

    # -- checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, step: int, extra_state: dict[str, Any] | None = None,
                        background: bool = False) -> str | None:
        """Write `checkpoints/<step>/` (rank 0 writes; every rank takes part in gathering). Returns its directory.

        `background`: return at once; `checkpoint.WRITER` writes the state and marks it STABLE in a thread. It
        writes the live parameters and AdamW state (no copy): the next optimizer step, save or restore waits
        for it."""
        checkpoint.WRITER.wait()
        model_state = get_model_state_dict(self.model, options=FULL_STATE)
        if self.peft is not None:  # the frozen base is the base model's own files: a checkpoint holds the adapter
            trainable = self.trainable_names()
            model_state = {name: value for name, value in model_state.items() if name in trainable}
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL_STATE)
        directory = None
        if self.rank == 0:
            parts = {
                "model": model_state,
                "optimizer": optimizer_state,
                # small and changed by the caller or the next step: copied (the tensors are written before they change)
                "trainer": copy.deepcopy({"step": step, "scheduler": self.scheduler.state_dict(),
                                          "rng": checkpoint.rng_state()}),
                "extra_state": copy.deepcopy(dict(extra_state or {})),
            }
            save = checkpoint.WRITER.start if background else checkpoint.save_checkpoint
            directory = save(self.storage, step, parts)
        if self.distributed:
            dist.barrier()
        return directory

    def restore(self) -> tuple[int | None, dict[str, Any]]:
        """Load the latest STABLE checkpoint if any; returns (its step, the algorithms' extra state) or (None, {})."""
        checkpoint.WRITER.wait()
        step = self.storage.latest_stable(checkpoint.KIND)
        if step is None:
            return None, {}
        options = StateDictOptions(full_state_dict=True)
        model_state = checkpoint.load_part(self.storage, step, "model")
        if self.peft is not None:
            check_adapter_state(model_state, self.trainable_names(), step)
            options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, model_state, options=options)
        set_optimizer_state_dict(
            self.model, self.optimizer, checkpoint.load_part(self.storage, step, "optimizer"), options=options
        )
        state = checkpoint.load_part(self.storage, step, "trainer")
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        self.step = state["step"]
        return self.step, checkpoint.load_part(self.storage, step, "extra_state")

    def trainable_names(self) -> set[str]:
        """State-dict names of the parameters the optimizer updates (all of them without LoRA)."""
        return {name for name, param in self.module.named_parameters() if param.requires_grad}

    def _tied_aliases(self) -> list[str]:
        """Names of parameters that are another one (tied embeddings); the full state dict has unshared copies."""
        seen: set[int] = set()
        aliases = []
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                aliases.append(name)
            seen.add(id(param))
        return aliases

    # -- weights for the sampler ----------------------------------------------------------
    def export_weights(self, step: int) -> str:
        """Write `weights/<step>/` in Hugging Face format (+ STABLE), loadable by transformers and vLLM as-is.

        The float32 master weights are cast to `model.dtype`, which config.json's `dtype` names; with a compute
        copy, refreshed into it, which the next step then computes with. With `[model.lora]` it is the peft adapter
        alone (`export_adapter`).
        """
        if self.peft is not None:
            return self.export_adapter(step)
        if self.compute is not None:
            self.compute.refresh()
            state = self.compute.module.state_dict()
        else:
            state = get_model_state_dict(self.model, options=FULL_STATE)
        for alias in self._tied_aliases():
            state.pop(alias, None)
        state = {name: value.to(self.dtype) if value.is_floating_point() else value for name, value in state.items()}
        directory = self.storage.path(checkpoint.WEIGHTS, step_name(step))
        if self.rank == 0:
            with self.storage.staged_dir(directory) as staging:
                self.module.save_pretrained(staging, state_dict=state, safe_serialization=True)
                set_config_dtype(os.path.join(staging, "config.json"), self.dtype)
                self.tokenizer.save_pretrained(staging)
        if self.distributed:
            dist.barrier()
        return directory

    def export_adapter(self, step: int) -> str:
        """Write `weights/<step>/` as a peft adapter directory (+ STABLE): `adapter_config.json` and
        `adapter_model.safetensors` (peft's tensor names, cast to `model.dtype`), what vLLM's LoRA loader and
        peft's `PeftModel.from_pretrained` read."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        from trace_rl.models.lora import ADAPTER_WEIGHTS

        adapter = get_peft_model_state_dict(self.peft)
        directory = self.storage.path(checkpoint.WEIGHTS, step_name(step))
        if self.rank == 0:
            with self.storage.staged_dir(directory) as staging:
                tensors = {name: value.detach().to("cpu", self.dtype).contiguous() for name, value in adapter.items()}
                save_file(tensors, os.path.join(staging, ADAPTER_WEIGHTS), metadata={"format": "pt"})
                self.peft.peft_config["default"].save_pretrained(staging)
        if self.distributed:
            dist.barrier()
        return directory


def check_adapter_state(state: dict[str, torch.Tensor], expected: set[str], step: int) -> None:
    """A LoRA checkpoint must hold exactly the adapter's parameters (else it is of another `[model.lora]`)."""
    if set(state) != expected:
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"the checkpoint of step {step} does not hold this run's LoRA adapter (missing {missing[:3]}, "
            f"unknown {unknown[:3]}); was [model.lora] changed? Resume with the config the run was started with"
        )
