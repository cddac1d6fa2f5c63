"""A vLLM worker extension: reload weights in place, refreshing a tied output layer too.

vLLM's CPU backend keeps a pre-packed copy of the output layer's weight for its GEMM
kernel. With tied embeddings (the tiny model, Qwen2.5 small models) the checkpoint has no
`lm_head.weight`, so `reload_weights` updates the shared embedding but never re-packs the
output layer, and logits keep using the old weights. `reload_weights_tied` reloads, then
re-runs the output layer's post-load processing (a no-op where nothing is packed).

In-process engines load it automatically; start a server with
`--worker-extension-cls trace_rl.inference.vllm_worker.WeightReload`.
"""

from __future__ import annotations

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
