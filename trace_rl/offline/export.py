"""`trace-rl export RUN --step N --merged DIR | --adapter DIR`: a step's weights as a directory other tools load.

`--merged` writes full Hugging Face weights (safetensors, config, tokenizer) that transformers and vLLM load
as-is. For a LoRA run (`[model.lora]`, docs/lora.md) they are the base model with the step's adapter folded in:

    W' = W + (alpha / r) * B A        for every adapted Linear W

cast to `model.dtype`; for a full-weight run, `weights/<N>/` itself. `--adapter` writes a LoRA run's peft adapter
(`adapter_config.json`, `adapter_model.safetensors`) for `PeftModel.from_pretrained` or vLLM's `LoRARequest`.
Each output is written to a staging directory beside it and renamed into place when complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trace_rl.errors import RefusedError
from trace_rl.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir
from trace_rl.offline.replay import source_config
from trace_rl.storage import RunStorage, step_name


def check_target(flag: str, target: str) -> Path:
    path = Path(target).resolve()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise RefusedError(f"{flag} {target} exists and is not an empty directory; choose a new one")
    return path


def export_step(run: str, step: int, merged: str | None = None, adapter: str | None = None,
                storage_options: dict[str, Any] | None = None) -> list[Path]:
    """Write step `step`'s weights of the run at `run` (`<storage>/<name>`) to `merged` and/or `adapter`."""
    if merged is None and adapter is None:
        raise RefusedError("export: pass --merged DIR (full Hugging Face weights) and/or --adapter DIR (the peft "
                           "adapter of a LoRA run)")
    config = source_config(run, storage_options, flag="RUN")
    storage = RunStorage.from_url(run, storage_options)
    available = storage.stable_steps("weights")
    if step not in available:
        raise RefusedError(missing_step(storage.url, step, available))
    targets = {flag: check_target(flag, target) for flag, target in (("--merged", merged), ("--adapter", adapter))
               if target is not None}
    if "--adapter" in targets and config.model.lora is None:  # refused before anything is downloaded
        raise RefusedError(f"step {step} of {storage.url} holds full weights (the run has no [model.lora]), not "
                           "an adapter; export them with --merged")
    written = []
    with tempfile.TemporaryDirectory(prefix="trace-rl-export-") as tmp:
        weights = os.path.join(tmp, "weights")
        storage.download_dir(storage.path("weights", step_name(step)), weights)
        lora = is_adapter_dir(weights)
        for flag, target in targets.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
            try:
                if flag == "--adapter":
                    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                        shutil.copy2(os.path.join(weights, name), staging / name)
                elif lora:
                    write_merged(config, weights, str(staging))
                else:
                    shutil.copytree(weights, staging, dirs_exist_ok=True)
                if target.exists():
                    target.rmdir()  # checked empty above
                os.replace(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            written.append(target)
    return written


def missing_step(url: str, step: int, available: list[int]) -> str:
    """The refusal of `--step` `step` when the run has no complete weights of it, with the steps it has."""
    if not available:
        return f"--step {step}: {url} has no complete weights of any step yet; train it first (trace-rl train)"
    if 0 < step < available[-1]:
        why = "pruned after training: [ckpt] keeps only some steps' weights, docs/trainer.md"
    elif step > available[-1]:
        why = "not trained yet"
    else:
        why = "steps count from 1"
    return (f"--step {step}: {url} has no complete weights of step {step} ({why}); steps with weights: "
            f"{', '.join(map(str, available))}; pass one of them, e.g. --step {available[-1]}")


def write_merged(config, adapter_dir: str, out_dir: str) -> None:
    """The run's base model with the adapter in `adapter_dir` merged in, saved in `model.dtype` (the adapter's
    dtype: `auto` resolved where the run trained) with its tokenizer."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trace_rl.models.hub import resolve_model_path
    from trace_rl.models.runtime import load_tokenizer
    from trace_rl.trainer.trainer import set_config_dtype

    base_path = resolve_model_path(config.model.name, config.model.revision)
    dtype = next(iter(load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS)).values())).dtype
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)  # merge in float32, then cast
    model = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    set_config_dtype(os.path.join(out_dir, "config.json"), dtype)
    load_tokenizer(base_path).save_pretrained(out_dir)
