"""A vLLM worker extension: reload weights in place, refreshing a tied output layer too; on CPU, keep a
half-precision model's float32 output layer in float32, run RMSNorm with vLLM's own kernels, and sleep when idle.

vLLM's CPU backend keeps a pre-packed copy of the output layer's weight for its GEMM
kernel. With tied embeddings (the tiny model, Qwen2.5 small models) the checkpoint has no
`lm_head.weight`, so `reload_weights` updates the shared embedding but never re-packs the
output layer, and logits keep using the old weights. `reload_weights_tied` reloads, then
re-runs the output layer's post-load processing (a no-op where nothing is packed).

A bfloat16 engine computes its logits in float32 (`head_dtype = "float32"`, as the trainer does). On CUDA vLLM
runs that as a half-precision GEMM with a float32 output; on CPU it casts the output layer's whole weight to float32
in every forward pass: 28 M values for SmolLM2-135M, 44 of the 160 ms of a 32-sequence decode step on a 2-core
Xeon. `keep_float32_output_layer` makes that copy once, when the engine starts and after each reload, and has the
logits computed from it: the same float32 GEMM of the same values, so the same logits. For a bfloat16 model that
GEMM runs in oneDNN's bfloat16 math mode (`trace_rl.models.bfloat16_products`): the same exact products of bfloat16
values, their float32 sums in another order, at the bfloat16 rate (12.6 to 6.6 ms for 32 rows of SmolLM2-135M).
The mode is process-wide, so only where the worker's process is not the caller's (vLLM's multiprocessing, its
default): there the model's one forward pass at a time is all that computes.

vLLM 0.32 registers its C++ RMSNorm kernels (`torch.ops._C.rms_norm`, `fused_add_rms_norm`, in its CPU build too)
for GPUs only, so on CPU every norm ran PyTorch's element-wise ops: 35-50 us a call against 6-18 us for 32 rows of
SmolLM2-135M, 61 calls a decode step. `use_cpu_norm_kernels` has each plain RMSNorm call them, as vLLM's CUDA path
does (the residual added and normalized in place): `LLM.generate` of the demo's step 3.6 s to 3.2 s in bfloat16.
The kernels normalize each row on its own, in float32, as the native norm does: the outputs agree to a rounding
of the model's dtype.

vLLM's worker spins for its next request a whole second after each one it reads (a `SpinCondition` over its
request queue), on the cores that a CPU machine's trainer uses next: the demo's bfloat16 trainer step right after
sampling took 2.24 s against 2.04 s on the 2-core AMX Xeon. `spin_briefly_when_idle` has a CPU worker spin
`CPU_WORKER_SPIN_SECONDS`, then sleep on the queue's socket until a request comes; sampling is as fast.

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
CPU_SETUP_METHOD = "set_up_cpu_model"
FLOAT32_COPY = "trace_rl_float32_weight"  # the attribute of the output layer holding its float32 copy
# how long a CPU worker spins for its next request before it sleeps on the request queue's socket: longer than
# the engine's scheduling between two decode steps, far shorter than vLLM's 1 s that the trainer would share cores with
CPU_WORKER_SPIN_SECONDS = 0.01


class WeightReload:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def reload_weights_tied(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(lm_head, "quant_method"):
            lm_head.quant_method.process_weights_after_loading(lm_head)
        self.set_up_cpu_model()

    def set_up_cpu_model(self) -> None:
        """On CPU, `keep_float32_output_layer`, `use_cpu_norm_kernels` and `spin_briefly_when_idle` (at the engine's
        start and after each reload); does nothing elsewhere."""
        self.keep_float32_output_layer()
        self.use_cpu_norm_kernels()
        self.spin_briefly_when_idle()

    def spin_briefly_when_idle(self) -> None:
        """On CPU, have this worker spin `CPU_WORKER_SPIN_SECONDS` at most for its next request, then sleep until one
        comes (vLLM spins 1 s). The request queue is the `WorkerProc`'s that runs this call, found up the stack;
        nothing changes elsewhere, or under an executor without one."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        frame = sys._getframe(1)
        while frame is not None:
            queue = getattr(frame.f_locals.get("self"), "rpc_broadcast_mq", None)
            condition = getattr(queue, "_spin_condition", None)
            if getattr(condition, "is_reader", False) and hasattr(condition, "busy_loop_s"):
                condition.busy_loop_s = CPU_WORKER_SPIN_SECONDS
                return
            frame = frame.f_back

    def use_cpu_norm_kernels(self) -> None:
        """On CPU, have each RMSNorm with a weight of its input's dtype run vLLM's C++ kernels (once per module)."""
        import torch
        from vllm.model_executor.layers.layernorm import RMSNorm

        if not hasattr(torch.ops._C, "fused_add_rms_norm"):
            return
        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            if (type(module) is RMSNorm and isinstance(weight, torch.Tensor) and weight.device.type == "cpu"
                    and module.has_weight and module.variance_size_override is None
                    and not isinstance(module.__dict__.get("_forward_method"), _KernelNorm)):
                module._forward_method = _KernelNorm(module)

    def keep_float32_output_layer(self) -> None:
        """On CPU, where a half-precision model's logits are float32: (re)make the output layer's float32 copy and
        have each logits processor project with it. Does nothing elsewhere."""
        import torch
        from vllm import envs
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        weight = getattr(lm_head, "weight", None)
        if weight is None or weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
            return  # a float32 model, or a quantized output layer (its weight holds packed values)
        processors = [m for m in model.modules()
                      if isinstance(m, LogitsProcessor) and m.head_dtype == torch.float32]
        if not processors:
            return
        copy = getattr(lm_head, FLOAT32_COPY, None)
        if copy is None:
            setattr(lm_head, FLOAT32_COPY, weight.detach().float())
        else:
            copy.copy_(weight.detach())
        bfloat16_gemms = weight.dtype == torch.bfloat16 and envs.VLLM_ENABLE_V1_MULTIPROCESSING
        for processor in processors:
            if not isinstance(processor.__dict__.get("_apply_head"), _Float32Head):
                processor._apply_head = _Float32Head(processor._apply_head, bfloat16_gemms)


class _Float32Head:
    """A logits processor's `_apply_head` that projects a half-precision hidden state with the output layer's float32
    copy, where it has one: `F.linear(hidden.float(), weight.float(), bias.float())` as vLLM computes it, with
    `weight.float()` made once; with `bfloat16_gemms`, in oneDNN's bfloat16 math mode."""

    def __init__(self, apply_head, bfloat16_gemms: bool):
        self.apply_head, self.bfloat16_gemms = apply_head, bfloat16_gemms

    def __call__(self, lm_head, hidden_states, embedding_bias):
        import torch

        from trace_rl.models.bfloat16_products import bfloat16_products

        weight = getattr(lm_head, FLOAT32_COPY, None)
        if weight is None or hidden_states.dtype == torch.float32:
            return self.apply_head(lm_head, hidden_states, embedding_bias)
        bias = None if embedding_bias is None else embedding_bias.float()
        with bfloat16_products(self.bfloat16_gemms and hidden_states.dtype == torch.bfloat16 and bias is None):
            return torch.nn.functional.linear(hidden_states.float(), weight, bias)


class _KernelNorm:
    """An RMSNorm's forward through vLLM's C++ kernels, where the input has the weight's dtype (else its own)."""

    def __init__(self, norm):
        self.norm = norm

    def __call__(self, x, residual=None):
        import torch

        norm = self.norm
        if x.dtype != norm.weight.dtype or not x.is_contiguous() or (
                residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous())):
            return norm.forward_native(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, norm.weight.data, norm.variance_epsilon)
            return out
        torch.ops._C.fused_add_rms_norm(x, residual, norm.weight.data, norm.variance_epsilon)
        return x, residual


def exit_without_final_collection() -> None:
    """At exit: freeze the heap, so the interpreter's last collection has nothing to walk (the process's memory
    goes back to the system all the same). Triton's bindings would then report their still-referenced objects as
    leaks, a page of text per process: standard error is closed first."""
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    gc.freeze()


if multiprocessing.current_process().name != "MainProcess":  # a process vLLM started (its workers load this)
    atexit.register(exit_without_final_collection)
