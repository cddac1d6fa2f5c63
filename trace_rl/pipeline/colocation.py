"""Which in-process engines a run starts, and how they share one GPU with the trainer (docs/scaling.md).

An engine is started only for a model something uses: the actor, which samples the rollouts, and
the models the step's local algorithms score with (`Algorithm.models_used`, e.g. opd's `model`), and the
`[trainer.loss.kl]` reference.
With `actor = "reference"` and no algorithm that scores with the policy, no policy engine exists,
and nothing is broadcast to one.

The in-process vLLM engines share one memory budget, `[inference] gpu_memory_utilization`, split
equally among them. When they share a CUDA device with the trainer (`[inference] colocate`, by
default whenever the trainer runs on CUDA), they start with vLLM's sleep mode and sleep at level 1
(weights copied to CPU memory, KV cache freed) while the trainer trains, then wake up to load the
new weights.

Plain Python: the decisions are tested on CPU with real configs.
"""

from __future__ import annotations

import os
import sys

from trace_rl.config import Config
from trace_rl.models.dtype import resolved_dtype
from trace_rl.models.runtime import RuntimeConfig
from trace_rl.names import POLICY


def models_in_use(config: Config) -> list[str]:
    """Model keys something in the run uses, the actor first, then the local algorithms' models in order."""
    from trace_rl.algorithms.base import validate_options
    from trace_rl.algorithms.lookup import resolve_algorithm_class

    used = [config.actor]
    for env in config.env:
        if env.algorithm_server is not None:
            continue  # env-owned algorithms run on the env server, with the runtimes it builds
        for algo in config.algorithms_for(env):
            cls = resolve_algorithm_class(algo.id)
            if cls is not None:
                used += sorted(cls.models_used(validate_options(cls, algo)))
    if config.trainer.loss.kl is not None:  # the KL reference scores every step's batch
        used.append(config.trainer.loss.kl.model)
    return list(dict.fromkeys(used))


def in_process_engine(config: Config, key: str) -> bool:
    """Whether model `key` runs on an in-process vLLM engine (not a server, not the hf sampler)."""
    if key == POLICY:
        return config.inference.backend == "vllm" and not config.inference.base_url
    model = config.models[key]
    return model.tokens and config.inference.backend == "vllm" and not model.base_url


def engines(config: Config) -> list[str]:
    """The in-process vLLM engines the run starts, by model key."""
    return [key for key in models_in_use(config) if in_process_engine(config, key)]


def memory_shares(config: Config) -> dict[str, float]:
    """Each engine's `gpu_memory_utilization`: the budget split equally among the engines that exist."""
    keys = engines(config)
    return {key: config.inference.gpu_memory_utilization / len(keys) for key in keys}


def trainer_on_cuda(config: Config, cuda_available: bool) -> bool:
    return config.trainer.device == "cuda" or (config.trainer.device == "auto" and cuda_available)


def colocated(config: Config, cuda_available: bool) -> bool:
    """Whether the engines sleep while the trainer runs: `[inference] colocate`, by default when the trainer
    is on CUDA (its rank 0 and vLLM both use the first visible GPU) and an in-process engine exists, and
    sampling does not overlap training (`[async] max_off_policy_steps = 0`: an engine that samples the next
    step while the trainer runs cannot sleep)."""
    if not engines(config) or not trainer_on_cuda(config, cuda_available) or config.async_.max_off_policy_steps:
        return False
    return config.inference.colocate is not False


def check_colocation(config: Config, on_this_machine: bool = False) -> list[str]:
    """Config-time problems: `colocate = true` with nothing to colocate. `on_this_machine`: the run starts
    here (`trace-rl train`, `serve`, `prepare_run`), so `trainer.device = 'auto'` on a machine without a GPU
    is a CPU trainer too (not checked for a run's config read elsewhere: export, eval, replay)."""
    if config.inference.colocate is not True:
        return []
    if config.trainer.device == "cpu":
        return [("inference.colocate = true: trainer.device = 'cpu' shares no GPU with the engines; "
                "remove inference.colocate or set trainer.device = 'auto' or 'cuda'")]
    if not engines(config):
        return [("inference.colocate = true: no model runs on an in-process vLLM engine (inference.backend = 'hf' "
                "or servers via base_url); remove inference.colocate")]
    if config.async_.max_off_policy_steps:
        return [(f"inference.colocate = true with async.max_off_policy_steps = {config.async_.max_off_policy_steps}: "
                 "the engines sample the next steps while the trainer runs, so they cannot sleep for it; set "
                 "inference.colocate = false (and leave the trainer room: inference.gpu_memory_utilization), or "
                 "async.max_off_policy_steps = 0")]
    if on_this_machine and config.trainer.device == "auto" and not gpu_here():
        return [("inference.colocate = true: trainer.device = 'auto' trains on the CPU here (this machine has no "
                 "GPU), which shares no GPU with the engines; remove inference.colocate (by default the engines "
                 "colocate whenever the trainer is on CUDA)")]
    return []


def gpu_here() -> bool:
    """Whether torch may find a CUDA (or ROCm) device on this machine, decided without importing torch so that
    `--dry-run` stays fast: torch's own answer once it is imported; otherwise False only when that is certain
    (CUDA_VISIBLE_DEVICES hides every device, or no NVIDIA, ROCm or WSL GPU device exists)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        return torch.cuda.is_available()
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return any(os.path.exists(path) for path in GPU_DEVICES)


GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/kfd", "/dev/dxg")


def cuda_on_this_machine() -> bool:
    import torch

    return torch.cuda.is_available()


def runtime_configs(config: Config, cuda_available: bool | None = None) -> dict[str, RuntimeConfig]:
    """One RuntimeConfig per model key: `policy` from [model] + [inference], others from [models.<key>].

    An extra model named plain `tiny` gets its own seed (`seed`, default the run seed + 1),
    so a tiny reference differs from the tiny policy; the policy's name is kept verbatim,
    exactly as the trainer resolves it. Each in-process vLLM engine gets its share of
    `inference.gpu_memory_utilization`, and sleep mode when colocated with the trainer
    (`trace_rl.pipeline.colocation`; `cuda_available` None: ask torch). A `dtype = "auto"` becomes the dtype the
    trainer computes in on this machine (`trace_rl.models.dtype`), so sampler and trainer agree.
    """

    inference = config.inference
    if cuda_available is None:
        cuda_available = cuda_on_this_machine()
    shares = memory_shares(config)
    sleep_mode = colocated(config, cuda_available)
    trainer_cuda = cuda_available and config.trainer.device != "cpu"
    engine = {
        "backend": inference.backend,
        "max_model_len": inference.max_model_len,
        "max_num_batched_tokens": inference.max_num_batched_tokens,
        "cpu_kv_cache_gb": inference.cpu_kv_cache_gb,
        "step_sequences": min(sum(env.batch_size * env.group_size for env in config.env), inference.max_concurrent),
        "gpu_memory_utilization": inference.gpu_memory_utilization,
        "enforce_eager": inference.enforce_eager,
        "request_timeout_s": inference.request_timeout_s,
        "reload_timeout_s": inference.reload_timeout_s,
        "seed": config.seed,
        "sleep_mode": sleep_mode,
        "samples_beside_training": config.async_.max_off_policy_steps > 0,
    }
    configs = {
        POLICY: RuntimeConfig(
            key=POLICY,
            name=config.model.name,
            revision=config.model.revision,
            dtype=resolved_dtype(config.model.dtype, trainer_cuda, "sampler"),
            base_urls=[inference.base_url] if inference.base_url else [],
            stop_tokens=config.model.stop_tokens,
            lora=config.model.lora,
            **{**engine, "gpu_memory_utilization": shares.get(POLICY, inference.gpu_memory_utilization)},
        )
    }
    for key, model in config.models.items():
        seed = model.seed if model.seed is not None else config.seed + 1
        name = f"tiny:{seed}" if model.name == "tiny" else model.name
        urls = [model.base_url] if isinstance(model.base_url, str) else list(model.base_url or [])
        configs[key] = RuntimeConfig(
            key=key, name=name, revision=model.revision, dtype=resolved_dtype(model.dtype, trainer_cuda, "sampler"),
            tokens=model.tokens, base_urls=urls,
            stop_tokens=model.stop_tokens, base_of=POLICY if is_policy_base(config, model, name) else None,
            **{**engine, "seed": seed, "gpu_memory_utilization": shares.get(key, inference.gpu_memory_utilization)}
        )
    return configs


def is_policy_base(config: Config, model, name: str) -> bool:
    """Whether an extra model is the base of a LoRA policy (same files, dtype, stop tokens, no server of its own):
    then the policy's runtime serves it with the adapter off, and no second copy of the weights is loaded."""
    policy = config.model
    return (policy.lora is not None and model.tokens and not model.base_url and name == policy.name
            and model.revision == policy.revision and model.dtype == policy.dtype
            and model.stop_tokens == policy.stop_tokens)
