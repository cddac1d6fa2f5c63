"""The trainer: one optimizer step per training step over packed micro-batches.

Works in one process or as one rank of a `torch.distributed` job (DDP or FSDP2),
on CPU in fp32 or CUDA in bf16 alike: the device comes from `trainer.device` and
the dtype from `model.dtype`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trace_rl.config import Config
from trace_rl.storage import RunStorage, step_name
from trace_rl.tables import LOSS_NAMES, TrainingSample
from trace_rl.tiny import resolve_model_path
from trace_rl.trainer import checkpoint
from trace_rl.trainer.loss import compute_loss
from trace_rl.trainer.packing import CHANNEL_FIELDS, MicroBatch, assign_to_ranks, block_causal_mask, pack

WEIGHTS = "weights"
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """`auto` is CUDA when available; a distributed rank uses the GPU of its local rank."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def warmup_factor(warmup_steps: int):
    """LR multiplier: linear from 1/warmup_steps to 1 over the first `warmup_steps` steps, then 1."""
    return lambda index: min(1.0, (index + 1) / warmup_steps) if warmup_steps else 1.0


def token_logprobs(
    model: torch.nn.Module, batch: MicroBatch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs (with grad) and entropies (without) of a packed micro-batch at each sample's temperature.

    Position t predicts token t+1; the logits are divided by the temperature of the
    sample of token t+1 before the log-softmax. A sample's first token gets 0.
    """
    ids = torch.from_numpy(batch.input_ids).to(device)
    positions = torch.from_numpy(batch.position_ids).to(device)
    segments = torch.from_numpy(batch.segment_ids).to(device)
    temperature = torch.from_numpy(batch.temperature).to(device)
    dtype = next(model.parameters()).dtype
    mask = block_causal_mask(segments, dtype)
    logits = model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, use_cache=False).logits[0]
    logp = torch.log_softmax(logits[:-1].float() / temperature[1:, None], dim=-1)
    first = positions == 0
    zero = logp.new_zeros(1)
    lp = torch.cat([zero, logp.gather(-1, ids[1:, None]).squeeze(-1)])
    lp = torch.where(first, torch.zeros_like(lp), lp)
    with torch.no_grad():
        entropy = torch.cat([zero, -(logp.exp() * logp).sum(-1)])
        entropy = torch.where(first, torch.zeros_like(entropy), entropy)
    return lp, entropy


class Trainer:
    """The policy, its optimizer and LR schedule; one rank of a distributed job when a process group exists."""

    def __init__(self, config: Config, storage: RunStorage):
        self.config = config
        self.storage = storage
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.device = resolve_device(config.trainer.device, int(os.environ.get("LOCAL_RANK", 0)))
        torch.manual_seed(config.seed)

        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_path(config.model.name)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.module = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, config.model.dtype), attn_implementation="sdpa"
        ).to(self.device)
        self.module.config.use_cache = False
        self.module.train()
        self.model = self._parallelize(self.module)

        t = config.trainer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_factor(t.warmup_steps))
        self.step: int | None = None

    def _parallelize(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed:
            return module
        if self.config.trainer.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(module, device_ids=device_ids)
        from torch.distributed.fsdp import fully_shard

        block_names = set(getattr(module, "_no_split_modules", None) or [])
        for sub in module.modules():
            if type(sub).__name__ in block_names:
                fully_shard(sub)
        return fully_shard(module)

    def _gradient_sync(self, enabled: bool):
        """Sync gradients across ranks only on the last micro-batch of a step."""
        if not self.distributed:
            return contextlib.nullcontext()
        if self.config.trainer.parallel == "ddp":
            return contextlib.nullcontext() if enabled else self.model.no_sync()
        self.model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def _all_reduce(self, values: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(values)
        return values

    # -- training ---------------------------------------------------------------------
    def train_step(self, step: int, samples: list[TrainingSample]) -> dict[str, float]:
        """Pack the samples, accumulate the gradient over this rank's micro-batches, clip, and step."""
        t = self.config.trainer
        micro_batches = pack(samples, t.micro_batch_tokens, t.truncate)
        mine = assign_to_ranks(micro_batches, self.world_size)[self.rank]
        counts = self._all_reduce(
            torch.tensor(
                [[b.rl_mask.sum(), b.ce_mask.sum(), (b.rl_mask | b.ce_mask).sum()] for b in mine],
                dtype=torch.float64, device=self.device,
            ).sum(0)
        )
        rl_tokens, ce_tokens, loss_tokens = counts.tolist()
        scales = {"rl": rl_tokens, "ce": ce_tokens}

        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(mine):
            with self._gradient_sync(i == len(mine) - 1):
                lp, entropy = token_logprobs(self.model, batch, self.device)
                on_device = {name: torch.from_numpy(getattr(batch, name)).to(self.device) for name in CHANNEL_FIELDS}
                loss, metrics = compute_loss(
                    lp, on_device["inference_logprobs"],
                    {loss: (on_device[f"{loss}_values"], on_device[f"{loss}_mask"]) for loss in LOSS_NAMES},
                    scales, self.config.trainer.loss,
                )
                # DDP and FSDP average gradients over ranks; the scales already sum over ranks
                (loss * self.world_size).backward()
            loss_mask = on_device["rl_mask"] | on_device["ce_mask"]
            metrics["entropy"] = (entropy * loss_mask).sum() / max(loss_tokens, 1.0)
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value.double()
        names = sorted(totals)
        reduced = self._all_reduce(torch.stack([totals[n] for n in names])).tolist()

        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step = step
        result = dict(zip(names, reduced))
        result["loss"] = result["loss/rl"] + result["loss/ce"]
        result.update(
            grad_norm=float(grad_norm), lr=lr, tokens=float(sum(b.num_tokens for b in micro_batches)),
            micro_batches=float(len(micro_batches)), samples=float(len(samples)),
        )
        return result

    # -- checkpoints ------------------------------------------------------------------
    def save_checkpoint(self, step: int, extra_state: dict[str, Any] | None = None) -> str | None:
        """Write `checkpoints/<step>/` (rank 0 writes; every rank takes part in gathering). Returns its directory."""
        model_state = get_model_state_dict(self.model, options=FULL_STATE)
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL_STATE)
        directory = None
        if self.rank == 0:
            parts = {
                "model": model_state,
                "optimizer": optimizer_state,
                "trainer": {"step": step, "scheduler": self.scheduler.state_dict(), "rng": checkpoint.rng_state()},
                "extra_state": dict(extra_state or {}),
            }
            directory = checkpoint.save_checkpoint(self.storage, step, parts, self.config.ckpt)
        if self.distributed:
            dist.barrier()
        return directory

    def restore(self) -> tuple[int | None, dict[str, Any]]:
        """Load the latest STABLE checkpoint if any; returns (its step, the algorithms' extra state) or (None, {})."""
        step = self.storage.latest_stable(checkpoint.KIND)
        if step is None:
            return None, {}
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, checkpoint.load_part(self.storage, step, "model"), options=options)
        set_optimizer_state_dict(
            self.model, self.optimizer, checkpoint.load_part(self.storage, step, "optimizer"), options=options
        )
        state = checkpoint.load_part(self.storage, step, "trainer")
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        self.step = state["step"]
        return self.step, checkpoint.load_part(self.storage, step, "extra_state")

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
        """Write `weights/<step>/` in Hugging Face format (+ STABLE), loadable by transformers and vLLM as-is."""
        state = get_model_state_dict(self.model, options=FULL_STATE)
        for alias in self._tied_aliases():
            state.pop(alias, None)
        directory = self.storage.path(WEIGHTS, step_name(step))
        if self.rank == 0:
            with tempfile.TemporaryDirectory(prefix="trace-rl-weights-") as staging:
                self.module.save_pretrained(staging, state_dict=state, safe_serialization=True)
                self.tokenizer.save_pretrained(staging)
                self.storage.upload_dir(staging, directory)
        if self.distributed:
            dist.barrier()
        return directory
