"""A vLLM worker extension: reload weights in place, refreshing a tied output layer too.

vLLM's CPU backend keeps a pre-packed copy of the output layer's weight for its GEMM
kernel. With tied embeddings (the tiny model, Qwen2.5 small models) the checkpoint has no
`lm_head.weight`, so `reload_weights` updates the shared embedding but never re-packs the
output layer, and logits keep using the old weights. `reload_weights_tied` reloads, then
re-runs the output layer's post-load processing (a no-op where nothing is packed).

In-process engines load it automatically; start a server with
`--worker-extension-cls trace_rl.inference.vllm_worker.WeightReload`.

Loading it also makes the worker processes exit without the final garbage collection of their heap. That took
2-3 s on a 2-core CPU, before EngineCore's own, so an engine's shutdown outlasted vLLM's 5 s grace: every run
on the vLLM sampler ended with vLLM killing its engine and warning about it.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import sys

EXTENSION = "trace_rl.inference.vllm_worker.WeightReload"
RELOAD_METHOD = "reload_weights_tied"


class WeightReload:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def reload_weights_tied(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)


def exit_without_final_collection() -> None:
    """At exit: freeze the heap, so the interpreter's last collection has nothing to walk (the process's memory
    goes back to the system all the same). Triton's bindings would then report their still-referenced objects as
    leaks, a page of text per process: standard error is closed first."""
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    gc.freeze()


if multiprocessing.current_process().name != "MainProcess":  # a process vLLM started (its workers load this)
    atexit.register(exit_without_final_collection)
