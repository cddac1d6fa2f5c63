"""Model plumbing: names to local folders (Hub ids, GGUF files, the tiny model), LoRA adapters, the
runtime types every sampler implements, and chat rendering with the model's tokenizer."""

from trace_rl.moved import moved_name

# what the module trace_rl/models.py held until 2026-11-24, when it became this package
MOVED = {
    **dict.fromkeys(["TORCH_STATE_LOCK", "RuntimeConfig", "Generation", "ModelRuntime", "NEUTRAL_SAMPLING",
                     "StopTokenError", "stop_token_ids", "check_stop_tokens", "load_tokenizer"],
                    "trace_rl.models.runtime"),
    **dict.fromkeys(["runtime_configs", "is_policy_base"], "trace_rl.pipeline.colocation"),
    "build_runtime": "trace_rl.inference.build",
}


def __getattr__(name: str) -> object:
    return moved_name(__name__, name, MOVED)
