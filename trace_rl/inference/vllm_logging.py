"""What vLLM prints by default: its warnings and errors, less the ones known to be harmless here.

vLLM logs a few dozen INFO lines on every engine start and weight reload, and some warnings that say
nothing is wrong with a run:

- `RotaryEmbedding: Failed to load weights` on every weight reload: vLLM's in-place reload expects
  each tensor of a layer in the checkpoint, and the rotary cos/sin cache is computed, never stored;
- `ParallelLMHead: Failed to load weights` on every reload of a model with tied embeddings: its
  checkpoints (the Hub's and the trainer's alike) have no `lm_head.weight`, the output layer shares
  the embedding that was loaded, and trace-rl's worker extension re-packs it (vllm_worker.py). For a
  model without tied embeddings `lm_head.weight` is required by the weight check before any reload,
  so this warning cannot hide a missing output layer;
- `Attempted to load weight ... with dtype torch.float32 into parameter with dtype torch.bfloat16` (or
  float16), once per tensor on every load of a float32 checkpoint (the tiny models, a converted GGUF) into an
  engine of `model.dtype` bfloat16/float16: the weight loader casts each tensor to that dtype, as asked;
- notes about the CPU platform and about settings trace-rl chose on purpose: Triton is missing,
  the V1 model runner, eager mode, chunked prefill off (vllm_engine.py says why), LD_PRELOAD hints, the SSM cache
  type of a model without one; on a CPU of 2 cores, that the model computes on both (no core kept for the
  scheduler) and that its worker then runs two threads.

`--verbose` (`TRACE_RL_VERBOSE=1`) shows everything, vLLM's INFO lines and progress bars included.
A logging set-up of the user's own (`VLLM_LOGGING_CONFIG_PATH`, `VLLM_CONFIGURE_LOGGING=0`) is
left alone.

The engine's processes apply this config as vLLM does (`dictConfig`); the process that builds the
engine does not (`configure_this_process`): `dictConfig` first flushes and closes every handler of the
process, and Prefect's API log handler flushes through Prefect's own threads. When one of them was
logging at that moment, it and the engine's start waited on each other for good (a step hung at its
engine's start). This process gets the same console handler on its `vllm` logger instead. A
logging set-up of the user's own is applied by vLLM here too, `dictConfig` and all, as without trace-rl.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

VERBOSE_ENV = "TRACE_RL_VERBOSE"
FILTER = "trace_rl_known_harmless"
HANDLER = "trace_rl_vllm_console"
KNOWN_HARMLESS = re.compile(
    r"^(RotaryEmbedding|ParallelLMHead): Failed to load weights$"
    r"|^Attempted to load weight \S+ with dtype torch\.float32 into parameter with dtype torch\.(bfloat16|float16)$"
    r"|^Triton is installed, but doesn't include CPU backend"
    r"|^Triton is not installed\. triton-cpu is expected"
    r"|^Model Runner V2 requires Triton"
    r"|^Enforce eager set, disabling torch\.compile"
    r"|^Inductor compilation was disabled by user settings"
    r"|^This model does not officially support disabling chunked prefill"
    r"|^(libtcmalloc|libiomp) is not found in LD_PRELOAD"
    r"|^Reset SSM cache type to float32 for accelerated GDN mamba backend"
    r"|^VLLM_CPU_NUM_OF_RESERVED_CPU is less than the minimum requirement"
    r"|^OMP_NUM_THREADS=\d+ is set; leaving Torch threads at \d+ for serving"
    r"|^vLLM has deprecated support for supporting different tokenizers for different LoRAs"  # ours have none
)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class KnownHarmless(logging.Filter):
    """Drops the records of KNOWN_HARMLESS (unless verbose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return verbose() or not KNOWN_HARMLESS.search(record.getMessage())


def quiet_config(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's logging config (as `VLLM_LOGGING_CONFIG_PATH` takes it) with its console handler at WARNING and
    without the known-harmless warnings; unchanged when verbose."""
    if verbose():
        return config
    config.setdefault("filters", {})[FILTER] = {"()": f"{__name__}.KnownHarmless"}
    handler = config["handlers"]["vllm"]
    handler["level"] = "WARNING"
    handler["filters"] = [*handler.get("filters", []), FILTER]
    return config


def quiet_imports() -> None:
    """Drop the known-harmless warning vLLM logs while it is imported, before its logging is set up."""
    logger = logging.getLogger("vllm.triton_utils.importing")
    if not any(isinstance(f, KnownHarmless) for f in logger.filters):
        logger.addFilter(KnownHarmless())


def configure_this_process(error_log: str) -> logging.Handler:
    """Set up vLLM's logging in this process without `dictConfig` (the module docstring says why): its console
    handler (once; WARNING and no known-harmless records unless verbose) and a handler writing its ERROR records
    to `error_log` (returned, for the caller to remove), and tell vLLM its config is applied, so an engine built
    now does not apply it here. Call it with `VLLM_LOGGING_CONFIG_PATH` set as the engine's processes get it."""
    import vllm.logger
    from vllm import envs
    from vllm.config.logging import LoggingConfig

    vllm_logger = logging.getLogger("vllm")
    if not any(handler.get_name() == HANDLER for handler in vllm_logger.handlers):
        console = logging.StreamHandler(sys.stderr if envs.VLLM_LOGGING_STREAM == "ext://sys.stderr" else sys.stdout)
        console.set_name(HANDLER)
        console.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                                               "%m-%d %H:%M:%S"))
        if not verbose():
            console.setLevel(logging.WARNING)
            console.addFilter(KnownHarmless())
        vllm_logger.addHandler(console)
        vllm_logger.setLevel(envs.VLLM_LOGGING_LEVEL)
        vllm_logger.propagate = False
    errors = logging.FileHandler(error_log)
    errors.setLevel(logging.ERROR)
    vllm_logger.addHandler(errors)
    # the config an engine built now computes from the environment (`EngineArgs.create_logging_config`)
    vllm.logger._last_configured_logging_config = LoggingConfig()
    return errors
