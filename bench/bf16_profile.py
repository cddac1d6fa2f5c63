"""The structure of a bfloat16 trainer step, op by op and dtype by dtype, and its distance from the bfloat16 floor:
`python -m bench.bf16_profile`.

One `Trainer.optimizer_step` in `--dtype` (bfloat16) on GRPO groups (`bench.gpu_check.grpo_samples`) is run
under a dispatch-mode counter that sees every aten op of the forward, the backward and the optimizer: its
name, the dtypes it reads and writes, its FLOPs (torch's flop formulas: matmuls and attention) and the bytes
it reads and writes (views count none). The table groups them:

- casts: a copy that changes the dtype (`_to_copy`, `copy_`), a weight's (the source is a parameter, of the
  float32 master or of the compute copy) apart from the others (activations, gradients);
- matmuls: the ops with FLOPs, by the dtype they compute in (float32 on bfloat16 data is work at the float32 rate);
- element-wise and the rest, by dtype.

Every count is the same on any CPU; the seconds are not. The step's bfloat16 floor is its FLOPs at this
device's bfloat16 matmul rate (a square matmul's, `bench.trainer.matmul_flops_per_s`); `step / floor` and
the step against the same step in float32 are the issue-44 targets (within 2x of the floor; the demo step 2x
faster than float32). On a CPU without bfloat16 matmul units (AVX2 only: bfloat16 is emulated at about 1
GFLOP/s) the rates say nothing, the structure everything. `--profile` adds torch.profiler's self time per op
(with input shapes), where the time goes on the machine it runs on.

    python -m bench.bf16_profile --layers 2 --hidden 64 --groups 1     # this AVX2 CPU: structure, in seconds
    python -m bench.bf16_profile --profile                               # AMX CPU or GPU: Qwen2.5-0.5B's shape
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from bench.gpu_check import grpo_samples, trainer_config
from bench.trainer import matmul_flops_per_s, synchronize
from trace_rl.storage import RunStorage
from trace_rl.trainer.trainer import Trainer

CASTS = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
MIN_SHARE = 0.01  # an op without FLOPs and under this share of the step's bytes is summed into "the rest"
SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}


def short(dtype: torch.dtype) -> str:
    return SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass
class OpRow:
    """The ops of one (kind, phase, op, dtypes) group in a step: how many, their FLOPs and bytes."""

    count: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclass
class StepOps:
    """Every op of a step by (kind, phase, op, dtypes), and the micro-batches it had."""

    rows: dict[tuple[str, str, str, str], OpRow] = field(default_factory=lambda: collections.defaultdict(OpRow))
    micro_batches: int = 0

    def total(self, kind: str | None = None, phase: str | None = None, dtype: str | None = None) -> OpRow:
        """The sum of the rows of a kind (`weight cast`, `cast`, `matmul`, `other`), phase and dtypes (a substring)."""
        out = OpRow()
        for (k, p, _, dtypes), row in self.rows.items():
            if (kind is None or k == kind) and (phase is None or p == phase) and (dtype is None or dtype in dtypes):
                out.count += row.count
                out.flops += row.flops
                out.bytes += row.bytes
        return out


class OpCounter(TorchDispatchMode):
    """Counts every aten op into `StepOps`; a cast whose source is one of `weights` (data pointers) is a weight cast.
    The phase is `backward` inside the autograd engine (a recomputed chunk's forward too), `optimizer` while `phase`
    says so, else `forward` (with the loss and the gradients' transfer to the master weights)."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.weights = weights
        self.ops = StepOps()
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        floating_in = [t for t in inputs if t.is_floating_point()]
        floating_out = [t for t in outputs if t.is_floating_point()]
        if not floating_in and not floating_out:
            return out
        phase = "backward" if torch._C._current_autograd_node() is not None else self.phase
        if func in CASTS:
            source = inputs[-1]  # _to_copy(self), copy_(self, src)
            target = outputs[0]
            if source.dtype == target.dtype:
                kind = "other"
            else:
                kind = "weight cast" if source.data_ptr() in self.weights else "cast"
            dtypes = f"{short(source.dtype)}->{short(target.dtype)}"
        else:
            packet = func.overloadpacket
            flops = op_flops(packet, args, kwargs, out)
            kind = "matmul" if flops else "other"
            dtypes = ",".join(sorted({short(t.dtype) for t in floating_in})) or "-"
            dtypes += "->" + (",".join(sorted({short(t.dtype) for t in floating_out})) or "-")
        row = self.ops.rows[(kind, phase, str(func.overloadpacket).removeprefix("aten."), dtypes)]
        row.count += 1
        row.flops += flops if kind == "matmul" else 0
        if not func.is_view:  # a view moves no data
            row.bytes += sum(t.numel() * t.element_size() for t in inputs + outputs)
        return out


def op_flops(packet, args, kwargs, out) -> int:
    """torch's FLOP formula for the op (0 for an op without one). Its attention formulas require as many key/value
    heads as query heads; a grouped-query call (CUDA's kernels take the grouped key/value) counts as the same call
    with the key/value heads repeated, which is the work the kernel does."""
    if packet not in flop_registry:
        return 0
    try:
        return flop_registry[packet](*args, **kwargs, out_val=out)
    except AssertionError:
        heads = next(t.shape[1] for t in args if isinstance(t, torch.Tensor) and t.dim() == 4)
        repeated = [torch.empty(t.shape[0], heads, *t.shape[2:], device="meta", dtype=t.dtype)
                    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] != heads else t for t in args]
        return flop_registry[packet](*repeated, **kwargs, out_val=out)


def weight_pointers(trainer: Trainer) -> set[int]:
    """Data pointers of every parameter the step may cast: the master weights' and the compute copy's."""
    modules = [trainer.module, trainer.compute_model]
    return {p.data_ptr() for module in modules for p in module.parameters()}


def counted_step(trainer: Trainer, step: int, samples) -> StepOps:
    """One optimizer step under `OpCounter`."""
    counter = OpCounter(weight_pointers(trainer))

    def entering(optimizer, args, kwargs):
        counter.phase = "optimizer"

    pre = trainer.optimizer.register_step_pre_hook(entering)
    try:
        with counter:
            metrics = trainer.optimizer_step(step, samples)
    finally:
        pre.remove()
    counter.ops.micro_batches = int(metrics["micro_batches"])
    return counter.ops


def step_seconds(trainer: Trainer, first: int, steps: int, samples) -> float:
    """Median seconds of `steps` optimizer steps (numbered from `first`)."""
    seconds = []
    for step in range(first, first + steps):
        synchronize(trainer.device)
        started = time.perf_counter()
        trainer.optimizer_step(step, samples)
        synchronize(trainer.device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def table(ops: StepOps) -> str:
    """The markdown table of a step's ops, casts first, then by FLOPs and bytes; small ops without FLOPs summed."""
    flops, nbytes = ops.total().flops or 1.0, ops.total().bytes or 1.0
    order = {"weight cast": 0, "cast": 1, "matmul": 2, "other": 3}
    lines = ["| kind | phase | op | dtypes | per step | per micro-batch | GFLOP | FLOPs share | MB | bytes share |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rest = OpRow()
    for (kind, phase, op, dtypes), row in sorted(ops.rows.items(),
                                                 key=lambda item: (order[item[0][0]], -item[1].flops, -item[1].bytes)):
        if kind == "other" and row.bytes / nbytes < MIN_SHARE:
            rest.count, rest.bytes = rest.count + row.count, rest.bytes + row.bytes
            continue
        lines.append(f"| {kind} | {phase} | {op} | {dtypes} | {row.count} | {row.count / ops.micro_batches:.1f} | "
                     f"{row.flops / 1e9:.3f} | {row.flops / flops:.1%} | {row.bytes / 2**20:.1f} | "
                     f"{row.bytes / nbytes:.1%} |")
    lines.append(f"| other | all | the rest (each under {MIN_SHARE:.0%} of the bytes) | - | {rest.count} | "
                 f"{rest.count / ops.micro_batches:.1f} | 0 | 0.0% | {rest.bytes / 2**20:.1f} | {rest.bytes / nbytes:.1%} |")
    return "\n".join(lines)


def summary(ops: StepOps) -> dict[str, float]:
    """What keeps a half-precision step from its matmul rate, as counts and shares of the step's FLOPs and bytes."""
    everything = ops.total()
    weight_casts = ops.total("weight cast")
    float32_matmuls = ops.total("matmul", dtype="f32->")
    return {
        "micro_batches": ops.micro_batches, "gflop": everything.flops / 1e9, "mb": everything.bytes / 2**20,
        "weight_casts": weight_casts.count, "weight_casts_per_micro_batch": weight_casts.count / ops.micro_batches,
        "weight_cast_bytes_share": weight_casts.bytes / everything.bytes,
        "other_casts": ops.total("cast").count, "other_cast_bytes_share": ops.total("cast").bytes / everything.bytes,
        "float32_matmul_flops_share": float32_matmuls.flops / everything.flops,
        "float32_other_bytes_share": ops.total("other", dtype="f32").bytes / everything.bytes,
    }


def build_model(args: argparse.Namespace) -> str:
    """The realistic fixture (Qwen's 151,936-token vocabulary) at Qwen2.5-0.5B's shape, with `--layers` and
    `--hidden` where given."""
    from trace_rl.models import realistic

    architecture = dict(realistic.QWEN25_05B)
    if args.layers:
        architecture["num_hidden_layers"] = args.layers
    if args.hidden:  # Qwen2.5-0.5B's 14 heads of 64 and 2 KV heads, scaled
        heads = max(2, args.hidden // 64)
        architecture.update(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 2,
                            num_attention_heads=heads, num_key_value_heads=max(1, heads // 7))
    return str(realistic.build_realistic_model(Path(args.cache), architecture=architecture))


def run(model: str, dtype: str, groups: int, prompt_tokens: int, completion_tokens: int, micro_batch_tokens: int,
        steps: int, profile: bool = False, attention: str = "auto", output_layer: str = "chunked") -> dict:
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))
    samples = grpo_samples(groups, prompt_tokens, completion_tokens, vocab)
    result = {"dtype": dtype, "threads": torch.get_num_threads(), "output_layer": output_layer}
    with tempfile.TemporaryDirectory(prefix="trace-rl-bf16-profile-") as storage:
        trainers = {}
        for name in ("float32", dtype):
            config = trainer_config(model, storage, name, attention, micro_batch_tokens, output_layer=output_layer)
            trainers[name] = Trainer(config, RunStorage.of(config))
            trainers[name].optimizer_step(0, samples)  # warm-up: allocations, AdamW state
        # interleaved, a step of each in turn: a load that comes and goes on a shared machine hits both alike
        seconds = {name: [] for name in trainers}
        for step in range(1, steps + 1):
            for name, trainer in trainers.items():
                seconds[name].append(step_seconds(trainer, step, 1, samples))
        for name in trainers:
            result[f"{name}_step_seconds"] = statistics.median(seconds[name])
            print(f"{name} step: {result[f'{name}_step_seconds']:.3f} s ({trainers[name].attention})", flush=True)
        del trainers["float32"]
        trainer = trainers[dtype]
        ops = counted_step(trainer, steps + 1, samples)
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
            with torch_profile(activities=activities, record_shapes=True) as profiler:
                trainer.optimizer_step(steps + 2, samples)
            sort = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
            result["profile"] = profiler.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=25)
        result["parameters"] = sum(p.numel() for p in trainer.module.parameters())
        result["device"] = str(trainer.device)
    matmul_rate = matmul_flops_per_s(torch.device(result["device"]), getattr(torch, dtype))
    result.update(ops=ops, summary=summary(ops), table=table(ops), matmul_flops_per_s=matmul_rate,
                  floor_seconds=ops.total().flops / matmul_rate)
    result["floor_ratio"] = result[f"{dtype}_step_seconds"] / result["floor_seconds"]
    result["speedup_over_float32"] = result["float32_step_seconds"] / result[f"{dtype}_step_seconds"]
    return result


def report(result: dict) -> str:
    s, dtype = result["summary"], result["dtype"]
    return "\n".join([
        f"{result['parameters'] / 1e6:,.1f}M parameters, {dtype}, {result['output_layer']} output layer, "
        f"{result['device']}, {result['threads']} threads; "
        f"one step: {s['micro_batches']} micro-batches, {s['gflop']:.2f} GFLOP, {s['mb']:,.0f} MB touched",
        f"weight casts: {s['weight_casts']} per step ({s['weight_casts_per_micro_batch']:.1f} per micro-batch), "
        f"{s['weight_cast_bytes_share']:.1%} of the bytes; other casts: {s['other_casts']}, "
        f"{s['other_cast_bytes_share']:.1%} of the bytes",
        f"float32 matmuls: {s['float32_matmul_flops_share']:.1%} of the FLOPs; float32 element-wise and other ops: "
        f"{s['float32_other_bytes_share']:.1%} of the bytes",
        f"step: {result[f'{dtype}_step_seconds']:.3f} s in {dtype}, {result['float32_step_seconds']:.3f} s in float32 "
        f"({result['speedup_over_float32']:.2f}x); {dtype} matmul rate {result['matmul_flops_per_s'] / 1e9:,.1f} "
        f"GFLOP/s, floor {result['floor_seconds']:.3f} s, step / floor {result['floor_ratio']:.1f}",
        "", result["table"], *(["", result["profile"]] if "profile" in result else [])])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: the realistic fixture at the shape below)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: Qwen2.5-0.5B's 24)")
    parser.add_argument("--hidden", type=int, help="hidden size (default: Qwen2.5-0.5B's 896)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--groups", type=int, default=4, help="GRPO groups of 8 completions")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per dtype, after a warm-up")
    parser.add_argument("--attention", default="auto", help="trainer.attention (the op counter cannot see inside "
                        "packed_flex's FlexAttention call: on CUDA pass packed_sdpa)")
    parser.add_argument("--output-layer", default="chunked", choices=["chunked", "float32"],
                        help="trainer.output_layer of both runs")
    parser.add_argument("--profile", action="store_true", help="torch.profiler's self time per op and shape too")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "trace-rl-bf16-profile-models"))
    args = parser.parse_args(argv)
    model = args.model or build_model(args)
    result = run(model, args.dtype, args.groups, args.prompt_tokens, args.completion_tokens,
                 args.micro_batch_tokens, args.steps, args.profile, args.attention, args.output_layer)
    print(report(result))
    return result


if __name__ == "__main__":
    main()
