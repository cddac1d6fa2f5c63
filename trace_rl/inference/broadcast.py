"""Weight broadcast: make the sampler use the weights the trainer exported for a step.

The trainer writes `weights/<step:06d>/` (safetensors + config, marked STABLE). The
broadcast stages that directory on local disk when the run lives in object storage,
then asks the runtime to load it: an in-process vLLM engine reloads in place, a vLLM
server is paused, reloaded and resumed through its dev-mode routes, and the hf runtime
copies the state dict. Every runtime checks the new weights before touching the old
ones, so a failed broadcast leaves the sampler on its previous `policy_step`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from trace_rl.models.runtime import ModelRuntime
from trace_rl.models.tiny import cache_dir
from trace_rl.storage import RunStorage, step_name


class BroadcastError(RuntimeError):
    """A broadcast failed; the sampler still runs the weights it had before."""


def backend_name(runtime: ModelRuntime) -> str:
    config = runtime.config
    if config.base_urls:
        return f"vllm server ({', '.join(config.base_urls)})"
    return "vllm in-process engine" if config.backend == "vllm" else "hf in-process model"


def stage_weights(storage: RunStorage, step: int) -> str:
    """A local directory holding `weights/<step>/`: the directory itself on a local disk, else a cached copy."""
    directory = storage.path("weights", step_name(step))
    if not storage.is_stable(directory):
        raise FileNotFoundError(f"{storage.url_of('weights', step_name(step))} is missing or not STABLE yet")
    if storage.protocol in ("file", "local"):
        return directory
    run_id = hashlib.sha256(storage.url.encode()).hexdigest()[:12]
    target = cache_dir() / "weights" / run_id / step_name(step)
    if target.exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        storage.download_dir(directory, str(staging))
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


async def broadcast_weights(runtime: ModelRuntime, storage: RunStorage, step: int) -> None:
    """Load `weights/<step>/` into the runtime and record `runtime.policy_step = step`."""
    try:
        local_dir = stage_weights(storage, step)
        await runtime.load_weights(local_dir, step)
    except Exception as exc:
        raise BroadcastError(
            f"weight broadcast of step {step} to the {backend_name(runtime)} for {runtime.key!r} failed "
            f"(still on policy_step {getattr(runtime, 'policy_step', 0)}): {type(exc).__name__}: {exc}"
        ) from exc
    runtime.policy_step = step
