"""Run configuration: the pydantic models of a run's TOML, with `--set key=value` overrides.

This module is the schema only and imports nothing of trace_rl but leaf modules; the checks
against the env and algorithm registries and the disk live in `trace_rl.runs.loading`, which is
what loads a run's config. Importing either stays cheap (no torch, no vllm) for `--dry-run`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from trace_rl.credentials import StorageOptions
from trace_rl.names import POLICY
from trace_rl.options import known_keys


class AlgorithmConfig(BaseModel):
    """`id` plus the algorithm's own keys, flat: `{id = "echo", user = {alpha = 0.5}}`."""

    model_config = ConfigDict(extra="allow", frozen=True)
    id: str

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any] | AlgorithmConfig) -> AlgorithmConfig:
        if isinstance(spec, AlgorithmConfig):
            return spec
        if isinstance(spec, str):
            return cls(id=spec)
        return cls(**spec)


# An algorithm is written as its id ("grpo") or a table ({id = "echo", user = {alpha = 0.5}}).
AlgorithmSpec = Annotated[
    AlgorithmConfig,
    BeforeValidator(AlgorithmConfig.parse),
    WithJsonSchema({"anyOf": [
        {"type": "string", "description": "an algorithm id"},
        {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"], "additionalProperties": True,
         "description": "an algorithm id with its options"},
    ]}),
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# the attention and MLP projections of Llama-style decoders (Qwen2/3, Llama, Mistral): peft's names of their Linears
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Strict):
    """`[model.lora]`: train low-rank adapters (peft LoRA) instead of the full weights; see docs/lora.md."""

    rank: int = Field(..., gt=0, description="LoRA rank r of every adapted projection")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator: the update is (alpha / rank) * B A x")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1,
        description="names of the Linear modules that get an adapter (default: attention and MLP projections)")


class ModelConfig(Strict):
    """The trained model (`[model]`); at run time its key is `policy`."""

    name: str = Field("tiny", description="HF id, local directory, 'tiny' (built offline), a .gguf file or "
                      "'smollm2-135m' (converted once); see docs/models.md")
    revision: str | None = Field(
        None, description="for an HF id: branch, tag or commit hash of the snapshot every process loads "
        "(default 'main'; a commit hash pins it); ignored for 'tiny' and local directories")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="the sampler's weights and the trainer's compute (a copy of its weights in that dtype) and export dtype; "
        "the trainer's master weights stay float32. auto, per side: bfloat16 when the trainer runs on CUDA or on a "
        "CPU with AMX; on AVX512-BF16 without AMX bfloat16 for the trainer, float32 for the samplers; float32 "
        "elsewhere (docs/trainer.md)")
    stop_tokens: list[str] | None = Field(
        None, min_length=1, description="tokens that end a model turn, the first being the chat template's "
        "end-of-turn token (default: the tokenizer's eos token), e.g. ['<|im_end|>', '<|endoftext|>']")
    lora: LoraConfig | None = Field(
        None, description="[model.lora]: train LoRA adapters only, broadcast only the adapter (docs/lora.md)")


class ExtraModelConfig(ModelConfig):
    """Another model (`[models.<key>]`), e.g. a reference for distillation."""

    tokens: bool = Field(False, description="token-capable: can sample token ids with logprobs and score token sequences")
    base_url: str | list[str] | None = Field(None, description="vLLM server URL(s); several are used round-robin")
    seed: int | None = Field(None, description="seed for the 'tiny' builder (default: the run seed + 1)")


class InferenceConfig(Strict):
    """The policy's sampler (`[inference]`)."""

    backend: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm: in-process vLLM engine (or a server with base_url); hf: transformers generate")
    base_url: str | None = Field(None, description="a running vLLM OpenAI-compatible server for the policy")
    max_model_len: int = Field(1024, gt=0, description="longest sequence (prompt + completion) the engine serves")
    max_num_batched_tokens: int | None = Field(
        None, gt=0, description="vLLM's token budget per engine step (default: vLLM's; on CPU at least max_model_len,"
        " since chunked prefill is off there, see docs/inference.md)")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="GPU memory share of all in-process vLLM engines together, split equally "
        "among the engines the run starts (GPU only; docs/scaling.md)")
    colocate: bool | None = Field(
        None, description="in-process vLLM engines sleep (level 1: weights to CPU, KV cache freed) while the trainer "
        "runs and wake up for the weight load after it; default: true when they share a CUDA device with the "
        "trainer")
    cpu_kv_cache_gb: float | None = Field(
        None, gt=0, description="KV cache size on CPU (vLLM CPU backend); none: sized to a step, its rollouts in "
        "flight (sum of batch_size x group_size, at most max_concurrent) x max_model_len tokens, +25% "
        "(docs/inference.md)")
    enforce_eager: bool = Field(True, description="vLLM without CUDA graphs / compilation (faster start)")
    max_concurrent: int = Field(64, gt=0, description="rollouts in flight at once")
    request_timeout_s: float = Field(120.0, gt=0, description="one generate/score call; past it: a retryable error")
    reload_timeout_s: float = Field(
        600.0, gt=0, description="one weight reload of an in-process vLLM engine; past it the step fails")
    max_retries: int = Field(3, ge=0, description="retries of a retryable rollout error, with backoff")
    retry_backoff_s: float = Field(1.0, ge=0, description="backoff before the first retry; doubles each retry")


class SamplingConfig(Strict):
    """`[sampling]`, overridable per env with `[env.sampling]`; recorded on every branch."""

    temperature: float = Field(1.0, gt=0, description="sampling temperature; trainer logprobs use the same")
    max_completion_tokens: int = Field(64, gt=0, description="tokens per model turn")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    stop: list[str] = Field(
        default_factory=list, description="stop strings: a turn ends with the token that completes one (the token "
        "is kept), matched on the turn's text without special tokens; stop tokens are the model's `stop_tokens`")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, stop: list[str]) -> list[str]:
        if "" in stop:
            raise ValueError("an empty stop string would end every turn at once; remove it")
        return stop


VERIFIERS_SERVER_SCHEME = "tcp://"  # a verifiers env server (verifiers.v1.serve: ZMQ)


class EnvConfig(Strict):
    """One `[[env]]` entry."""

    id: str = Field(..., description="a builtin env id (docs/envs.md) or 'package.module:Class'")
    batch_size: int = Field(8, gt=0, description="examples per step")
    group_size: int = Field(8, gt=0, description="rollouts per example")
    algorithms: list[AlgorithmSpec] | None = Field(None, description="replaces the top-level list for this env")
    args: dict[str, Any] = Field(default_factory=dict, description="the environment's own options")
    server: str | None = Field(
        None, description="http(s)://: trace-rl's env server, for env-owned algorithms (docs/remote.md); "
        "tcp://HOST:PORT (id 'verifiers' only): a verifiers env server that plays the env's episodes")
    import_paths: list[str] = Field(
        default_factory=list, description="folders (relative to the working directory) put on sys.path before the "
        "env loads, where the modules it names live (e.g. a verifiers taskset module)")
    select: dict[str, Any] | None = Field(
        None, description="id 'verifiers' only: which of the taskset's tasks the env uses, as verifiers' own "
        "SelectConfig (`vf-eval --select.*`): include / exclude (idx ranges such as [\"0:100\"], ids, keys, names), "
        "shuffle, seed, skip, limit (docs/envs.md#verifiers)")
    sampling: SamplingConfig | None = Field(None, description="replaces [sampling] for this env")
    max_error_fraction: float = Field(
        0.5, ge=0, le=1, description="the step fails, showing the first errors, when more than this fraction of "
        "the env's rollouts fail (the env raised, or retries ran out); 1: never")
    drop_uniform_groups: bool = Field(
        False, description="dynamic sampling (DAPO): drop the groups whose rewards are all equal (no advantage "
        "signal) before the algorithms run")
    refill_rounds: int = Field(
        0, ge=0, description="with drop_uniform_groups: sample up to this many further rounds of fresh groups "
        "(seeded by step and round) to refill the batch_size groups the drop left short")

    @model_validator(mode="after")
    def _dynamic_sampling(self) -> EnvConfig:
        if self.refill_rounds and not self.drop_uniform_groups:
            raise ValueError("refill_rounds refills the groups drop_uniform_groups drops: set drop_uniform_groups "
                             "= true, or remove refill_rounds")
        if self.drop_uniform_groups and self.group_size == 1:
            raise ValueError("drop_uniform_groups with group_size = 1 drops every group (one reward is always "
                             "uniform); raise group_size")
        return self

    @model_validator(mode="after")
    def _select_is_verifiers(self) -> EnvConfig:
        if self.select is not None and self.id != "verifiers":
            raise ValueError(f"select picks a verifiers taskset's tasks, and env {self.id!r} is no verifiers env; "
                             "remove select")
        return self

    @model_validator(mode="after")
    def _server_scheme(self) -> EnvConfig:
        if self.server is None or self.server.startswith(("http://", "https://")):
            return self
        if not self.server.startswith(VERIFIERS_SERVER_SCHEME):
            raise ValueError(f"server = {self.server!r}: trace-rl's env server is reached over http:// or https://, "
                             "a verifiers env server over tcp://HOST:PORT")
        if self.id != "verifiers":
            raise ValueError(f"server = {self.server!r}: a tcp:// server is a verifiers env server, which only env "
                             "id 'verifiers' plays on; use trace-rl's env server (http://) for env-owned algorithms")
        return self

    @property
    def algorithm_server(self) -> str | None:
        """trace-rl's env server (http), where the env's env-owned algorithms run, or None."""
        return None if self.verifiers_server else self.server

    @property
    def verifiers_server(self) -> str | None:
        """The verifiers env server (tcp) that plays the env's episodes, or None: they play in-process."""
        return self.server if self.server and self.server.startswith(VERIFIERS_SERVER_SCHEME) else None


# how token losses become the step's loss (docs/trainer.md, "Aggregation")
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# the flat [trainer.loss] keys that each belonged to some policies, and their key in those policies' own tables
FLAT_LOSS_KEYS = {
    "dppo_mask_low": (("dppo",), "mask_low"), "dppo_mask_high": (("dppo",), "mask_high"),
    "kl_tau": (("dppo",), "kl_tau"), "clip_low": (("ppo", "gspo", "cispo"), "clip_low"),
    "clip_high": (("ppo", "gspo", "cispo"), "clip_high"), "clip_c": (("ppo",), "clip_c"),
    "tau_pos": (("sapo",), "tau_pos"), "tau_neg": (("sapo",), "tau_neg"),
}


class CorrectionConfig(Strict):
    """`[trainer.loss.correction]`: the importance correction for the sampler/trainer mismatch (docs/trainer.md)."""

    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="the weight w: token: w_t = r_t; sequence: w = exp(sum of the sequence's log ratios); "
        "geometric: w = exp(their mean over the sequence's rl tokens)")
    mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: the token's weight becomes sg(min(w, high)) (TIS; only losses that "
        "weigh tokens by it: dppo, reinforce); mask: a token (or sequence) with w outside [low, high] leaves the "
        "loss (MIS / IcePop)")
    low: float | None = Field(None, ge=0, description="mode = 'mask' only: the lower bound of w (unset: 0, none)")
    high: float = Field(..., gt=0, description="truncate: the cap of w; mask: the upper bound of w")

    @model_validator(mode="after")
    def _bounds(self) -> CorrectionConfig:
        if self.low is not None and self.mode != "mask":
            raise ValueError("low is a bound of mode = 'mask' (truncate caps from above only): remove low or set "
                             "mode = 'mask'")
        if self.low is not None and self.low >= self.high:
            raise ValueError(f"low = {self.low:g} must be below high = {self.high:g}")
        return self


class KLConfig(Strict):
    """`[trainer.loss.kl]`: a KL penalty toward a reference model on the rl tokens (docs/trainer.md)."""

    model: str = Field("reference", description="the [models.<key>] (tokens = true) that scores the trained tokens "
                       "once per step; its logprobs are the batch's ref_logprobs column")
    coef: float = Field(1e-3, gt=0, description="weight of the penalty: the loss gains coef * estimator(lp - "
                        "lp_ref), aggregated over the rl tokens like the policy loss")
    estimator: Literal["k1", "k2", "k3", "k3+"] = Field(
        "k3", description="k1: d; k2: d**2 / 2; k3: exp(-d) - 1 + d; k3+: k3's value with k2's gradient "
        "(d = lp - lp_ref; Schulman 2020)")


class LossConfig(BaseModel):
    """`[trainer.loss]`, and the options of its policy loss in `[trainer.loss.<policy>]`: see docs/trainer.md.

    The schema takes any table as a loss's options; which losses exist and what their options are is checked
    against the registry (`trace_rl.losses`) once the config's `imports` are imported."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    policy: str = Field(
        "dppo", min_length=1, description="the rl policy loss: dppo (prime-rl's trust-region loss), ppo, gspo, "
        "cispo, sapo, reinforce, or a loss registered with @register_loss in a module of `imports`; its options go "
        "in [trainer.loss.<policy>] (docs/trainer.md)")
    aggregation: Aggregation | None = Field(
        None, description="how token losses become the step's loss, step-wide (unset: the policy's default: "
        "token-mean; seq-mean-token-mean for gspo and sapo)")
    norm_tokens: int | None = Field(
        None, gt=0, description="aggregation = 'seq-mean-token-sum-norm' only: the constant a sequence's token sum is "
        "divided by (unset: the largest sampling.max_completion_tokens of the run)")
    max_is_ratio: float | None = Field(
        None, gt=0, description="truncated importance sampling: cap the ratio pi/pi_inf in the policy gradient "
        "at this value (unset: no cap); shorthand of correction = {level = 'token', mode = 'truncate', high = ...}")
    correction: CorrectionConfig | None = Field(
        None, description="[trainer.loss.correction]: importance correction for the sampler/trainer mismatch "
        "(unset: none)")
    kl: KLConfig | None = Field(
        None, description="[trainer.loss.kl]: KL penalty toward a reference model's logprobs (unset: none)")

    @model_validator(mode="before")
    @classmethod
    def _other_keys_are_loss_tables(cls, data: Any) -> Any:
        """A key that is not a field must be a table (a loss's options); a flat key of old names its new place."""
        if not isinstance(data, dict):
            return data
        errors = []
        for key, value in data.items():
            if key in cls.model_fields or isinstance(value, dict):
                continue
            if key in FLAT_LOSS_KEYS:
                policies, new_key = FLAT_LOSS_KEYS[key]
                chosen = data.get("policy") in policies
                policy = data["policy"] if chosen else policies[0]
                others = "" if chosen else ", ".join(f"[trainer.loss.{p}]" for p in policies[1:])
                error = ValueError(f"moved to [trainer.loss.{policy}] {new_key}"
                                   + (f" (likewise {others})" if others else ""))
                errors.append({"type": "value_error", "loc": (key,), "input": value, "ctx": {"error": error}})
            else:
                errors.append({"type": "extra_forbidden", "loc": (key,), "input": value})
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @model_validator(mode="after")
    def _one_correction(self) -> LossConfig:
        if self.max_is_ratio is not None and self.correction is not None:
            raise ValueError("max_is_ratio is the shorthand of correction = {level = 'token', mode = 'truncate', "
                             "high = ...}: set one of them")
        return self

    @property
    def tables(self) -> dict[str, dict[str, Any]]:
        """The `[trainer.loss.<name>]` tables by name: the options of the loss `name`."""
        return dict(self.model_extra or {})

    @property
    def importance_correction(self) -> CorrectionConfig | None:
        """`correction`, or what `max_is_ratio` is the shorthand of."""
        if self.max_is_ratio is not None:
            return CorrectionConfig(level="token", mode="truncate", high=self.max_is_ratio)
        return self.correction


class TrainerConfig(Strict):
    """`[trainer]`: one AdamW step per training step, see docs/trainer.md."""

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warmup, in steps")
    micro_batch_tokens: int = Field(4096, gt=0, description="packed tokens per forward/backward: distinct "
                                    "positions, a shared prefix counted once")
    share_prefixes: bool = Field(True, description="pack samples that start with the same tokens (a group's "
                                 "prompt, a trace's common history) as a prefix tree computing the prefix once; "
                                 "false: every sample whole (docs/trainer.md)")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping")
    truncate: bool = Field(False, description="cut samples longer than micro_batch_tokens instead of failing")
    num_processes: int = Field(1, gt=0, description="torchrun workers; > 1: started once per run and kept up "
                               "across steps (docs/trainer.md)")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="with num_processes > 1 (or cpu_offload): DDP or FSDP2 (fully_shard)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    attention: Literal["auto", "packed_sdpa", "packed_flex"] = Field(
        "auto", description="attention over a packed micro-batch: packed_sdpa (one padded SDPA per layer), packed_flex "
        "(one FlexAttention call per layer, CUDA only); auto: packed_flex on CUDA, else packed_sdpa "
        "(docs/trainer.md)")
    output_layer: Literal["chunked", "float32"] = Field(
        "chunked", description="the scored positions' logprobs: chunked (vocabulary chunks in model.dtype with "
        "float32 sums and an online logsumexp, no full logits) or float32 (the float32 output layer and "
        "log-softmax over chunks of positions); the same numbers up to float32 summation order (docs/trainer.md)")
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile each decoder block; auto: on CUDA in one process, off on CPU "
        "(docs/trainer.md)")
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder block's activations in backward instead of keeping them "
        "(less memory, ~1/3 more compute); single process, DDP and FSDP")
    cpu_offload: bool = Field(
        False, description="FSDP2's CPU offload: parameters, gradients and AdamW state stay in CPU memory and each "
        "block's weights come to the GPU only while it computes; the optimizer step runs on the CPU. Needs "
        "parallel = 'fsdp'; with num_processes = 1 the trainer runs as one persistent worker (docs/scaling.md)")
    loss: LossConfig = Field(default_factory=LossConfig, description="[trainer.loss]")
    nnodes: int = Field(1, gt=0, description="machines the trainer runs on, num_processes workers each; > 1: node 0 "
                        "runs `trace-rl train`, node K `trace-rl trainer-node CONFIG --node-rank K` (docs/scaling.md)")
    rdzv_endpoint: str | None = Field(None, description="with nnodes > 1: 'host:port' of node 0, where torchrun's "
                                      "c10d rendezvous listens (every node must reach it)")
    join_timeout_s: float = Field(600.0, gt=0, description="with nnodes > 1: the first step fails, naming the "
                                  "missing node ranks, when the nodes have not all joined after this long")
    node_timeout_s: float = Field(60.0, gt=0, description="with nnodes > 1: a node whose heartbeat (in the run's "
                                  "storage) is this old is gone: the step fails naming it")

    @model_validator(mode="after")
    def _nodes_need_an_endpoint(self) -> TrainerConfig:
        if self.nnodes > 1:
            host, _, port = (self.rdzv_endpoint or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"trainer.nnodes = {self.nnodes} needs trainer.rdzv_endpoint = 'host:port' (node "
                                 f"0's address and a free port every node reaches), got {self.rdzv_endpoint!r}")
        return self

    @model_validator(mode="after")
    def _flex_needs_cuda(self) -> TrainerConfig:
        if self.attention == "packed_flex" and self.device == "cpu":
            raise ValueError("trainer.attention = 'packed_flex' needs CUDA (torch has no FlexAttention backward on "
                             "CPU) but trainer.device = 'cpu'; set trainer.attention = 'auto' or 'packed_sdpa'")
        return self

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> TrainerConfig:
        if self.cpu_offload and self.parallel != "fsdp":
            raise ValueError("trainer.cpu_offload = true needs trainer.parallel = 'fsdp' (FSDP2 offloads its shards; "
                             "DDP keeps a whole copy on every GPU): set trainer.parallel = 'fsdp'")
        return self

    @property
    def uses_workers(self) -> bool:
        """Whether training runs on persistent torchrun workers (trace_rl.trainer.launcher), not in this process."""
        return self.num_processes > 1 or self.cpu_offload or self.nnodes > 1


class CheckpointConfig(Strict):
    """`[ckpt]`: how often full checkpoints are written and how many checkpoints and weights stay (docs/trainer.md)."""

    keep: int = Field(2, ge=1, description="keep the last `keep` checkpoints and the last `keep` weights/<step> "
                      "(plus the weights a resume from a kept checkpoint samples with; with [async] the "
                      "max_off_policy_steps weights before it too)")
    keep_weights_every: int = Field(1, ge=0, description="also keep weights/<step> of every step that is a multiple "
                                    "of this (1: every step's, so any step can be replayed through an algorithm "
                                    "that scores with the policy, or exported; 0: only those `keep` keeps)")
    interval: int = Field(1, ge=1, description="write a full checkpoint (model, optimizer, RNG) every interval-th "
                          "step and at the last step; weights/<step> are written every step. A resume re-runs the "
                          "steps after the newest checkpoint")


class RemoteConfig(Strict):
    """How the trainer calls env servers (`[[env]] server = "http://..."`); see docs/remote.md."""

    timeout_s: float = Field(600.0, gt=0, description="seconds to wait for one run_algorithms reply")
    max_retries: int = Field(3, ge=0, description="retries of a refused connection, timeout, 5xx or malformed reply")
    retry_backoff_s: float = Field(1.0, ge=0, description="backoff before the first retry; doubles each retry")
    max_concurrent: int = Field(8, gt=0, description="groups in flight at once per remote algorithm")
    token_env: str = Field("TRACE_RL_ENV_SERVER_TOKEN", description="environment variable holding the bearer token")


class RolloutTableConfig(Strict):
    """`[prefect.rollouts]`: the rollouts each step shows in the Prefect UI, as a table artifact (docs/pipeline.md)."""

    count: int = Field(8, ge=0, description="rows per step (0: no table)")
    select: Literal["groups", "best", "worst", "random"] = Field(
        "groups", description="groups: the first groups in order, from each its best, its worst and one other at "
        "random; best / worst: the step's highest / lowest rewards; random: any, seeded by the run seed and step")
    max_chars: int = Field(400, ge=40, description="a longer prompt message or completion is cut in the middle to "
                           "this many characters, its start and end kept")


class PrefectConfig(Strict):
    """`[prefect]`; PREFECT_API_URL in the environment wins over it."""

    api_url: str | None = Field(None, description="a Prefect server to use instead of the embedded one")
    rollouts: RolloutTableConfig = Field(default_factory=RolloutTableConfig, description="[prefect.rollouts]")


class EvalConfig(Strict):
    """`[eval]`: held-out evaluation of the policy's weights (docs/eval.md)."""

    interval: int = Field(0, ge=0, description="evaluate every `interval` steps (0: only after the last step)")
    envs: list[EnvConfig] = Field(..., min_length=1, description="[[eval.envs]]: env configs, usually with an eval "
                                  "split (args.split = 'eval'); their batch_size and group_size are not used")
    k: int = Field(4, gt=0, description="samples per example; pass@k is reported for k in {1, k/2, k}")
    num_examples: int = Field(16, gt=0, description="examples per env")
    sampling: SamplingConfig | None = Field(None, description="[eval.sampling]: replaces [sampling] for eval")
    pass_reward: float = Field(1.0, description="a sample counts as correct (pass@k, avg@k) when its reward is at "
                               "least this")


class MlflowConfig(Strict):
    """`[logging.mlflow]`."""

    tracking_uri: str = Field("sqlite:///mlflow.db", description="an MLflow tracking server URL or a local database "
                              "(sqlite:///<file>); MLflow 3 refuses a ./mlruns directory unless "
                              "MLFLOW_ALLOW_FILE_STORE=true")
    experiment: str | None = Field(None, description="experiment name (default: the run name)")


class WandbConfig(Strict):
    """`[logging.wandb]`."""

    project: str = Field("trace-rl", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user)")
    mode: Literal["online", "offline"] = Field("online", description="offline: write ./wandb only, sync later")
    dir: str | None = Field(None, description="where W&B writes its files (default: the working directory)")


class LoggingConfig(Strict):
    """`[logging]`: experiment trackers that get the config, step and eval metrics (docs/eval.md)."""

    backends: list[str] = Field(default_factory=list, description="'mlflow', 'wandb', or the name of a "
                                "'trace_rl.trackers' entry point")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="[logging.mlflow]")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="[logging.wandb]")


class AsyncConfig(Strict):
    """`[async]`: sampling overlapped with training, with a fixed schedule of weight versions; see docs/async.md."""

    max_off_policy_steps: int = Field(
        0, ge=0, description="k: step n samples with the weights of step max(0, n - 1 - k), so sampling runs up to k "
        "steps ahead of training, beside it; 0: synchronous (step n samples with the weights of step n - 1, "
        "before it trains)")
    partial_rollout_tokens: int | None = Field(
        None, ge=1, description="N: partial rollouts: keep rollouts in flight across steps, each advanced in "
        "segments of at most N sampled tokens; a step trains each env's batch_size groups that ended first, the "
        "others continue next step under the new weights (envs played in-process that can be driven again; "
        "docs/async.md). Unset: every rollout of a step is sampled to its end")
    max_token_age: int | None = Field(
        None, ge=0, description="with partial_rollout_tokens: the oldest a trained token may be, in steps between "
        "the weights that sampled it and those its step trains from (step n trains from weights n - 1: a token "
        "of weights v is n - 1 - v old); older ones go by stale_tokens. Unset: max_off_policy_steps + the "
        "segments a rollout can need (the largest max_completion_tokens of the envs / partial_rollout_tokens, "
        "rounded up), which trains every token of a one-turn rollout")
    stale_tokens: Literal["mask", "drop"] = Field(
        "mask", description="a token older than max_token_age (only a rollout continued across steps holds one): "
        "'mask' leaves it out of the loss, 'drop' drops its whole rollout (docs/async.md)")

    @model_validator(mode="after")
    def _token_age_bounds_continued_tokens(self) -> AsyncConfig:
        if self.max_token_age is None:
            return self
        if self.partial_rollout_tokens is None:
            raise ValueError("async.max_token_age bounds the age of tokens continued across steps, which only "
                             "async.partial_rollout_tokens keeps: set partial_rollout_tokens or remove max_token_age")
        if self.max_token_age < self.max_off_policy_steps:
            raise ValueError(f"async.max_token_age = {self.max_token_age} would mask every token: the schedule "
                             f"samples tokens max_off_policy_steps = {self.max_off_policy_steps} steps old; set "
                             f"max_token_age >= {self.max_off_policy_steps}")
        return self


class Config(Strict):
    """A training run (the top level of the TOML file)."""

    # `async` is a Python keyword: the field is `async_`, the TOML key `async`
    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    name: str = Field(..., min_length=1, description="run name: the run lives at <storage>/<name>/")
    steps: int = Field(10, gt=0, description="training steps, numbered from 1")
    seed: int = Field(0, description="seeds sampling, data and the trainer: same config + seed, same weights")
    storage: str = Field("runs", description="fsspec URL or local path")
    storage_options: StorageOptions = Field(
        default_factory=dict, description="fsspec options, e.g. S3 endpoint; credential values (key, secret, token, "
        "password, ...) stay out of config.toml, flow parameters and the config hash; 'env:VARIABLE' or "
        "'prefect-secret:BLOCK' reads one when the run opens its storage (docs/storage.md)")
    imports: list[str] = Field(default_factory=list, description="modules imported before env and algorithm ids "
                               "and the policy loss are looked up, so that their @register_env, @register_algorithm "
                               "and @register_loss names resolve, e.g. ['my_envs']; found like import paths "
                               "(docs/envs.md); the trainer's processes import them too")
    actor: str = Field(POLICY, description="which model samples rollouts: 'policy' or a [models.<key>] with tokens")
    algorithms: list[AlgorithmSpec] = Field(default_factory=lambda: [AlgorithmConfig(id="grpo")], description=
                                              "default for every env: ids or {id = ..., <options>} tables")
    model: ModelConfig = Field(default_factory=ModelConfig, description="[model]: the trained model (key policy)")
    models: dict[str, ExtraModelConfig] = Field(default_factory=dict, description="[models.<key>]: other models")
    inference: InferenceConfig = Field(default_factory=InferenceConfig, description="[inference]")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="[sampling]")
    env: list[EnvConfig] = Field(..., min_length=1, description="[[env]]: at least one environment")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="[trainer]")
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig, description="[ckpt]")
    prefect: PrefectConfig = Field(default_factory=PrefectConfig, description="[prefect]")
    remote: RemoteConfig = Field(default_factory=RemoteConfig, description="[remote]")
    eval: EvalConfig | None = Field(None, description="[eval]: held-out evaluation (docs/eval.md)")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="[logging]: experiment tracking")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", description="[async]")

    @field_validator("name")
    @classmethod
    def _name_is_below_storage(cls, name: str) -> str:
        """`<storage>/<name>` is wiped by --overwrite: it must be a directory strictly below `storage`."""
        if any(part in ("", ".", "..") for part in name.replace("\\", "/").split("/")):
            raise ValueError(f"{name!r} must name a directory below `storage`: no '.' or '..' parts, no leading, "
                             "trailing or doubled '/'; e.g. name = 'my-run' or 'sweep/lr-1e-5'")
        return name

    @field_validator("models")
    @classmethod
    def _policy_is_reserved(cls, models: dict[str, ExtraModelConfig]) -> dict[str, ExtraModelConfig]:
        if POLICY in models:
            raise ValueError("'policy' is reserved for [model]; use another key, e.g. [models.reference]")
        return models

    @model_validator(mode="after")
    def _check_lora(self) -> Config:
        """LoRA trains the policy; the trainer's FSDP2 path shards full weights and is not built for adapters."""
        extra = [f"models.{key}.lora" for key, model in self.models.items() if model.lora is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)}: only the trained model has adapters; move it to [model.lora] "
                             "or remove it")
        if self.model.lora is not None and self.trainer.parallel == "fsdp":  # whatever num_processes is
            raise ValueError("model.lora with trainer.parallel = 'fsdp' is not supported; use trainer.parallel = "
                             "'ddp' (the default; adapters are small: every rank holds them whole), without "
                             "trainer.cpu_offload")
        return self

    @model_validator(mode="after")
    def _check_actor(self) -> Config:
        if self.actor != POLICY:
            if self.actor not in self.models:
                known = ", ".join([POLICY, *self.models])
                raise ValueError(f"actor: {self.actor!r} is not a model; use one of: {known}")
            if not self.models[self.actor].tokens:
                raise ValueError(f"actor: models.{self.actor} must set tokens = true to sample rollouts")
        return self

    @model_validator(mode="after")
    def _check_verifiers_servers(self) -> Config:
        """A verifiers env server samples the policy itself, from the actor's vLLM server."""
        envs = [(f"env.{i}", e) for i, e in enumerate(self.env)]
        envs += [(f"eval.envs.{i}", e) for i, e in enumerate(self.eval.envs)] if self.eval is not None else []
        served = [where for where, env in envs if env.verifiers_server]
        urls = self.inference.base_url if self.actor == POLICY else self.models[self.actor].base_url
        if served and not urls:
            key = "inference.base_url" if self.actor == POLICY else f"models.{self.actor}.base_url"
            raise ValueError(f"{served[0]}.server: a verifiers env server samples the actor itself, from a vLLM "
                             f"server it reaches; set {key} to one (vllm serve --enable-scale-out), or play the "
                             "env in-process (remove server)")
        return self

    @model_validator(mode="after")
    def _check_truncation(self) -> Config:
        """The trainer computes log_softmax(logits / T) over the whole vocabulary; a policy that samples from a
        top-p-truncated distribution would be trained on logprobs of a distribution it did not sample from."""
        if self.actor != POLICY:
            return self
        where = [("sampling", self.sampling)] + [(f"env.{i}.sampling", e.sampling) for i, e in enumerate(self.env)]
        truncated = [f"{name}.top_p = {s.top_p:g}" for name, s in where if s is not None and s.top_p < 1.0]
        if truncated:
            raise ValueError(
                f"{', '.join(truncated)}: the trained policy must sample from its full distribution (top_p = 1), "
                "since the trainer's logprobs and importance ratios are of the untruncated softmax; use temperature "
                "to sharpen sampling instead, or sample with another model (actor = '<key>')"
            )
        return self

    @model_validator(mode="after")
    def _check_micro_batch(self) -> Config:
        """A trace may be as long as the engines serve; one longer than a micro-batch fails the train stage."""
        tokens, longest = self.trainer.micro_batch_tokens, self.inference.max_model_len
        if tokens < longest and not self.trainer.truncate:
            raise ValueError(
                f"trainer.micro_batch_tokens = {tokens} is below inference.max_model_len = {longest}: a trace as "
                f"long as the engine serves would fail the train stage; raise trainer.micro_batch_tokens to "
                f"{longest}, lower inference.max_model_len to {tokens}, or set trainer.truncate = true to cut it")
        return self

    @model_validator(mode="after")
    def _check_kl(self) -> Config:
        """The KL penalty's reference must be a token-capable [models.<key>]: it scores the trained tokens."""
        kl = self.trainer.loss.kl
        if kl is None:
            return self
        if kl.model == POLICY:
            raise ValueError("trainer.loss.kl.model: 'policy' is the trained model itself (a KL of 0 to its own "
                             "sampler); name a frozen [models.<key>] with tokens = true, e.g. 'reference'")
        if kl.model not in self.models:
            known = ", ".join(self.models) or "none"
            raise ValueError(f"trainer.loss.kl.model: {kl.model!r} is not a model (models: {known}); add "
                             f"[models.{kl.model}] with tokens = true, or remove [trainer.loss.kl]")
        if not self.models[kl.model].tokens:
            raise ValueError(f"trainer.loss.kl.model: models.{kl.model} must set tokens = true: it scores the "
                             "trained tokens")
        return self

    def algorithms_for(self, env: EnvConfig) -> list[AlgorithmConfig]:
        return env.algorithms if env.algorithms is not None else self.algorithms

    def sampling_for(self, env: EnvConfig) -> SamplingConfig:
        return env.sampling or self.sampling

    @property
    def max_segments(self) -> int:
        """With partial rollouts: the segments a one-turn rollout can need, over the envs (1 without them)."""
        tokens = self.async_.partial_rollout_tokens
        if tokens is None:
            return 1
        return max(-(-self.sampling_for(env).max_completion_tokens // tokens) for env in self.env)

    @property
    def token_age_bound(self) -> int:
        """The oldest a trained token may be: `async.max_token_age`, else max_off_policy_steps + `max_segments`.

        A rollout of s segments trains with its first tokens k + s - 1 steps old; one step more keeps every token
        of an ended group that waits a step to train. Without partial rollouts no token is older than k."""
        if self.async_.max_token_age is not None:
            return self.async_.max_token_age
        if self.async_.partial_rollout_tokens is None:
            return self.async_.max_off_policy_steps
        return self.async_.max_off_policy_steps + self.max_segments


class ConfigError(ValueError):
    """Every problem in a config, one per line, each naming the key and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def _describe(err: dict, model: type[BaseModel]) -> str:
    loc = tuple(err["loc"])
    where = ".".join(str(p) for p in loc) or "<top level>"
    if err["type"] == "extra_forbidden":
        known = known_keys(model, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"remove it (known keys: {', '.join(known)})"
        return f"{where}: unknown key; {fix}"
    if err["type"] == "missing":
        return f"{where}: required key is missing; add it"
    msg = err["msg"].removeprefix("Value error, ")
    if "input" in err and err["type"] != "value_error":
        return f"{where}: {msg} (got {err['input']!r})"
    return f"{where}: {msg}" if where != "<top level>" else msg


# pydantic's name of a union member in an error's location: a type (`str`, "literal['auto']", `list[str]`), no key
UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|bytes)$|[^A-Za-z0-9_]")


def union_errors_merged(errors: list[dict]) -> list[dict]:
    """One error per value: pydantic reports a value that fits no member of a union (`trainer.compile`, `auto` or a
    bool) once per member, each under the member's name; merged, the key is the field's and the message says what
    each member wanted ("Input should be 'auto' or a valid boolean"). Only two or more errors of one value are
    members: a single one whose key merely looks like a type (`models.my-ref`) keeps its key."""
    def member_of(err: dict) -> tuple | None:
        loc = tuple(err["loc"])
        if err["type"] != "extra_forbidden" and loc and isinstance(loc[-1], str) and UNION_MEMBER.search(loc[-1]):
            return loc[:-1], repr(err.get("input"))
        return None

    groups: dict[tuple, list[dict]] = {}
    for err in errors:
        if (key := member_of(err)) is not None:
            groups.setdefault(key, []).append(err)
    merged, done = [], set()
    for err in errors:
        key = member_of(err)
        members = groups.get(key, []) if key is not None else []
        if len(members) < 2:
            merged.append(err)
        elif key not in done:
            done.add(key)
            wanted = [members[0]["msg"], *(m["msg"].removeprefix("Input should be ") for m in members[1:])]
            merged.append({**members[0], "loc": key[0], "msg": " or ".join(wanted)})
    return merged


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply `a.b.0.c=value` to a raw config dict; the value is parsed as TOML, else a string."""
    if "=" not in assignment:
        raise ConfigError([f"--set {assignment!r}: expected KEY=VALUE, e.g. --set trainer.lr=1e-5"])
    path, _, raw = assignment.partition("=")
    parts = path.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError([f"--set {path}: {'.'.join(parts[:i]) or 'list'} has no item {part}"])
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise ConfigError([f"--set {path}: {'.'.join(parts[:i + 1])} is a value, not a table or list"])
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError([f"--set {path}: no list item {last}"])
        node[int(last)] = _parse_value(raw)
    else:
        node[last] = _parse_value(raw)


def parse_config(data: dict[str, Any]) -> Config:
    """Build a Config from plain data, every schema problem collected into one ConfigError.

    Only the schema: the checks that need the env and algorithm registries or the disk run where
    a run is loaded (`trace_rl.runs.loading`)."""
    try:
        return Config(**data)
    except ValidationError as exc:
        raise ConfigError([_describe(err, Config) for err in union_errors_merged(exc.errors())]) from None


def read_config_data(path: str | Path, overrides: list[str] = ()) -> dict[str, Any]:
    """A TOML config file as plain data, with `--set` overrides applied."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such config file"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML: {exc}"]) from None
    for assignment in overrides:
        apply_override(data, assignment)
    return data


def config_to_toml(config: Config) -> str:
    """The resolved config as TOML (None values omitted), readable back by `read_config_data`."""
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


def config_hash(config: Config) -> str:
    """What a step's outputs depend on: the whole config except the step count, the Prefect server, eval and
    tracking (neither changes what a training step computes)."""
    data = config.model_dump(mode="json", exclude={"steps", "prefect", "eval", "logging"})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
