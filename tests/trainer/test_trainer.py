"""The trainer end to end on the tiny model: steps, resume, checkpoints, exported weights, torchrun workers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.conftest import make_batch, storage_for
from tests.trainer.test_loss_steps import SEQUENCE_LOSS
from trace_rl.tables import write_batch
from trace_rl.trainer import checkpoint
from trace_rl.trainer.lifecycle import train_one_step
from trace_rl.trainer.packing import pack
from trace_rl.trainer.resume import TrainerError
from trace_rl.trainer.trainer import NonFiniteError, Trainer, check_finite, clip_in_fused_adamw


def exported(storage, step: int) -> dict[str, torch.Tensor]:
    return load_file(f"{storage.path('weights', f'{step:06d}')}/model.safetensors")


def write_batches(storage, steps: int) -> None:
    for step in range(steps):
        write_batch(storage, step, make_batch(100 + step))


def test_step_trains_and_reports_metrics(make_config):
    config = make_config()
    trainer = Trainer(config, storage_for(config))
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    samples = make_batch(7)
    metrics = trainer.optimizer_step(0, samples)
    rl = sum(int(s.rl_mask[1:].sum()) for s in samples)
    ce = sum(int(s.ce_mask[1:].sum()) for s in samples)
    assert metrics["tokens/rl"] == rl and metrics["tokens/ce"] == ce and rl > 0 and ce > 0
    assert metrics["sample_tokens"] == sum(len(s) for s in samples) == metrics["tokens"]  # make_batch(7) shares nothing
    assert metrics["output_positions"] == rl + ce
    assert metrics["micro_batches"] > 1  # accumulation over several micro-batches
    assert metrics["loss"] == pytest.approx(metrics["loss/rl"] + metrics["loss/ce"])
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 5.0
    # the sampler's logprobs are made up (-4.5 to -7): trainer and sampler disagree by about a logprob per token
    assert metrics["mismatch/k3_kl"] > 0 and metrics["mismatch/mean_abs_logprob_diff"] > 0.1
    assert metrics["mismatch/is_capped_fraction"] == 0.0  # no max_is_ratio
    assert metrics["lr"] == pytest.approx(1e-3 / 2)  # warmup step 1 of 2
    assert any(not torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())


def test_step_without_masked_tokens_leaves_weights_unchanged(make_config):
    config = make_config()
    trainer = Trainer(config, storage_for(config))
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    samples = [dataclasses.replace(s, rl_mask=np.zeros(len(s), bool), ce_mask=np.zeros(len(s), bool))
               for s in make_batch(8)]
    metrics = trainer.optimizer_step(0, samples)
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())


def test_a_bfloat16_resume_equals_uninterrupted(make_config):
    """A bfloat16 run's float32 master weights and extra state restored bitwise (a float32 run resumed bitwise
    from its newest checkpoint: tests/trainer/test_checkpoint.py)."""
    steps, dtype = 4, "bfloat16"
    straight = make_config("straight", weight_decay=0.1)
    straight.model.dtype = dtype
    straight.ckpt.keep = steps  # weights/0 stays, to compare with
    store = storage_for(straight)
    write_batches(store, steps)
    trainer = Trainer(straight, store)
    for step in range(steps):
        train_one_step(straight, store, step, trainer)

    resumed = make_config("resumed", weight_decay=0.1)
    resumed.model.dtype = dtype
    store2 = storage_for(resumed)
    write_batches(store2, steps)
    first = Trainer(resumed, store2)
    for step in range(2):
        train_one_step(resumed, store2, step, first, extra_state={"rae": {"baseline": np.arange(3.0)}})
    del first
    torch.manual_seed(12345)  # a restored run must not depend on this process's RNG
    second = Trainer(resumed, store2)
    restored, extra = second.restore()
    assert restored == 1 and extra["rae"]["baseline"].tolist() == [0.0, 1.0, 2.0]
    for step in range(2, steps):
        train_one_step(resumed, store2, step, second)

    a, b = exported(store, steps - 1), exported(store2, steps - 1)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a) and {v.dtype for v in a.values()} == {getattr(torch, dtype)}
    assert not torch.equal(exported(store, 0)[next(iter(a))], a[next(iter(a))])
    # and the float32 master weights themselves (what the checkpoint holds)
    assert all(torch.equal(p, q) for p, q in zip(trainer.module.parameters(), second.module.parameters()))


def test_training_a_step_again_is_refused(make_config):
    config = make_config()
    store = storage_for(config)
    write_batches(store, 1)
    train_one_step(config, store, 0)
    with pytest.raises(TrainerError, match="checkpoint for step 0 already exists"):
        train_one_step(config, store, 0)


def test_exported_weights_load_with_transformers(make_config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = make_config()
    store = storage_for(config)
    trainer = Trainer(config, store)
    trainer.optimizer_step(0, make_batch(9))
    directory = trainer.export_weights(0)
    assert store.is_stable(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = torch.tensor([tokenizer.encode("hello")])
    trainer.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trainer.module(ids).logits, atol=0, rtol=0)


def test_checkpoint_and_weights_on_s3(make_config, s3_server):
    config = make_config().model_copy(update={
        "storage": f"s3://{s3_server['bucket']}", "storage_options": s3_server["storage_options"]})
    store = storage_for(config)
    write_batches(store, 1)
    train_one_step(config, store, 0, extra_state={"rae": {"n": 1}})
    fresh = Trainer(config, store)
    assert fresh.restore() == (0, {"rae": {"n": 1}})
    assert store.is_stable(store.path("weights", "000000"))


@pytest.mark.slow
@pytest.mark.parametrize("num_processes, parallel, activation_checkpointing, cpu_offload, loss", [
    (2, "ddp", False, False, SEQUENCE_LOSS), (2, "ddp", True, False, {}), (2, "fsdp", True, True, {}),
])
def test_gloo_workers_match_one_process(make_config, num_processes, parallel, activation_checkpointing, cpu_offload,
                                        loss):
    """The same step as one plain process: on two ranks, with a sequence aggregation (a sequence's tokens split
    over ranks), with activation checkpointing, and with FSDP2's CPU offload (shards and AdamW state in CPU memory);
    two FSDP ranks checkpoint their activations and offload in one launch (each launch costs seconds of start-up).
    One offloaded worker: tests/trainer/test_launcher.py::test_an_offloaded_worker_matches_one_process_and_restores_
    its_checkpoint_bitwise; two plain FSDP workers through whole steps: tests/flows/test_trainer_workers.py."""
    single = make_config("single", micro_batch_tokens=48, loss=loss)
    store1 = storage_for(single)
    write_batches(store1, 1)
    expected = train_one_step(single, store1, 0)

    double = make_config(f"workers-{parallel}", micro_batch_tokens=48, num_processes=num_processes, loss=loss,
                         parallel=parallel, activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload)
    assert double.trainer.uses_workers
    store2 = storage_for(double)
    write_batches(store2, 1)
    metrics = train_one_step(double, store2, 0)
    assert metrics["tokens"] == sum(b.num_tokens for b in pack(make_batch(100), 48, share_prefixes=True))
    assert abs(metrics["loss"] - expected["loss"]) <= 1e-6
    for name in ("grad_norm", "mismatch/token_ratio_min", "mismatch/seq_ratio_max", "clipped_fraction"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name

    a, b = exported(store1, 0), exported(store2, 0)
    initial = load_file(f"{single.model.name}/model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    assert max((a[k] - initial[k]).abs().max().item() for k in initial) > 1e-4
    assert store2.latest_stable("checkpoints") == 0


def test_bfloat16_step_and_export(make_config):
    config = make_config()
    config.model.dtype = "bfloat16"
    store = storage_for(config)
    trainer = Trainer(config, store)
    metrics = trainer.optimizer_step(0, make_batch(10))
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    directory = trainer.export_weights(0)
    weights = load_file(f"{directory}/model.safetensors")
    exported_dtype = store.read_json(f"{directory}/config.json").get("dtype")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16} and exported_dtype == "bfloat16"


def test_bfloat16_keeps_float32_master_weights_that_learn(make_config):
    """bfloat16 computes in bf16 on float32 master weights, so small AdamW updates are not rounded away.

    Before (parameters themselves in bf16, updated in bf16), 10 steps at lr 1e-5 changed 15.1% of the
    weights: an update of ~1e-5 is below half a bf16 ulp of most weights (2^-14 at 0.02). Now 3 steps
    change 99.997% of the master weights and 34% of the exported bf16 weights (10 steps: 99.998%, 48%).
    """
    config = make_config(lr=1e-5, warmup_steps=0)
    config.model.dtype = "bfloat16"
    store = storage_for(config)
    trainer = Trainer(config, store)
    assert {p.dtype for p in trainer.module.parameters()} == {torch.float32}
    before = {name: p.detach().clone() for name, p in trainer.module.named_parameters()}
    initial = {name: w.to(torch.bfloat16) for name, w in load_file(f"{config.model.name}/model.safetensors").items()}
    for step in range(3):
        trainer.optimizer_step(step, make_batch(100 + step))
    params = dict(trainer.module.named_parameters())
    changed = sum(int((params[n].detach() != before[n]).sum()) for n in before)
    assert changed / sum(p.numel() for p in before.values()) > 0.99
    # the optimizer state is float32 too, and so is the checkpoint
    assert {v.dtype for state in trainer.optimizer.state.values() for k, v in state.items() if k != "step"} == {
        torch.float32}
    trainer.save_checkpoint(2, {})
    assert {v.dtype for v in checkpoint.load_part(store, 2, "model").values()} == {torch.float32}

    weights = load_file(f"{trainer.export_weights(2)}/model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    moved = sum(int((weights[n] != initial[n]).sum()) for n in weights)
    assert moved / sum(w.numel() for w in weights.values()) > 0.25


def test_a_half_precision_step_runs_on_a_compute_copy_not_under_autocast(make_config):
    config = make_config()
    trainer = Trainer(config, storage_for(config))
    assert trainer.compute is None and trainer.compute_model is trainer.model
    assert not trainer.optimizer.defaults["fused"]  # float32: the for-loop AdamW, the weights bit for bit as before
    with trainer._autocast():
        assert not torch.is_autocast_enabled("cpu")  # float32: the computation of a plain float32 model
    config.model.dtype = "bfloat16"
    trainer = Trainer(config, storage_for(config))
    with trainer._autocast():
        assert not torch.is_autocast_enabled("cpu")  # the copy's parameters are bfloat16 already
    # every parameter of the copy in bfloat16 (the tied embedding and output layer one storage), the buffers
    # (rotary frequencies) float32, as in the sampler's bfloat16 model
    copy = trainer.compute_model
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in copy.buffers() if b.is_floating_point()} == {torch.float32}
    assert copy.get_output_embeddings().weight.data_ptr() == copy.get_input_embeddings().weight.data_ptr()
    assert {p.dtype for p in trainer.module.parameters()} == {torch.float32}
    assert trainer.optimizer.defaults["fused"]  # one pass per float32 master parameter
    # a step: the master weights get float32 gradients that equal the copy's, the copy holds none after it
    trainer.optimizer_step(0, make_batch(10))
    assert all(p.grad is None for p in copy.parameters())
    pairs = trainer.compute.refreshed
    assert not all(torch.equal(half, master.to(torch.bfloat16)) for master, half in pairs)  # AdamW moved the master
    # the export refreshes the copy (the fused AdamW's writes made known to it) and writes the copy's weights: the
    # updated master weights, rounded; the next step's refresh then writes nothing
    weights = load_file(f"{trainer.export_weights(0)}/model.safetensors")
    assert all(torch.equal(half, master.to(torch.bfloat16)) for master, half in pairs)
    named = dict(trainer.module.named_parameters())
    assert weights.keys() <= named.keys() and len(weights) == len(pairs)
    assert all(torch.equal(weights[name], named[name].to(torch.bfloat16)) for name in weights)
    versions = [half._version for _, half in pairs]
    trainer.compute.refresh()
    assert [half._version for _, half in pairs] == versions
    # a weight written in place (a checkpoint's restore) is cast again, and only it
    master, half = pairs[0]
    with torch.no_grad():
        master.add_(1.0)
    trainer.compute.refresh()
    assert torch.equal(half, master.to(torch.bfloat16)) and half._version == versions[0] + 1
    assert [half._version for _, half in pairs[1:]] == versions[1:]


def test_truncated_importance_sampling_reports_the_capped_fraction(make_config):
    # the made-up sampler logprobs (-4.5 to -7) sit on both sides of the untrained model's ~ -5.8
    config = make_config(loss={"max_is_ratio": 1.0})
    metrics = Trainer(config, storage_for(config)).optimizer_step(0, make_batch(7))
    assert 0.2 < metrics["mismatch/is_capped_fraction"] < 0.8


def test_a_non_finite_loss_stops_the_step_before_anything_changes(make_config):
    config = make_config()
    store = storage_for(config)
    samples = make_batch(100)
    poisoned = next(i for i, s in enumerate(samples) if s.rl_mask[1:].any())
    samples[poisoned].inference_logprobs[samples[poisoned].rl_mask] = np.nan
    write_batch(store, 0, samples)
    trainer = Trainer(config, store)
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"step 0: the 'rl' channel's loss of micro-batch \d+ \(of \d+ on rank 0\) "
                                             "is nan"):
        train_one_step(config, store, 0, trainer)
    assert all(torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())
    assert not trainer.optimizer.state  # AdamW never stepped
    assert store.latest_stable("checkpoints") is None and not store.exists(store.path("weights", "000000"))


def test_a_non_finite_gradient_norm_is_named():
    finite = [{"rl": 0.5, "ce": 0.0}, {"rl": 1.0, "ce": 2.0}]
    check_finite(3, finite, 2.0, 0)
    with pytest.raises(NonFiniteError, match="step 3: the gradient norm is inf although the losses of all 2"):
        check_finite(3, finite, float("inf"), 0)
    with pytest.raises(NonFiniteError, match=r"step 3: the 'ce' channel's loss of micro-batch 1 \(of 2 on rank 1\) is "
                                             "inf"):
        check_finite(3, [finite[0], {"rl": 1.0, "ce": float("inf")}], float("nan"), 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_chunked_output_layer_trains_as_the_float32_one(make_config, dtype):
    """`trainer.output_layer`: the same logits up to float32 summation order, so the same step within rounding."""
    results = {}
    for output_layer in ("chunked", "float32"):
        config = make_config(output_layer=output_layer)
        config.model.dtype = dtype
        trainer = Trainer(config, storage_for(config))
        metrics = trainer.optimizer_step(0, make_batch(10))
        results[output_layer] = metrics, [p.detach().clone() for p in trainer.module.parameters()]
    (chunked, chunked_weights), (float32, float32_weights) = results.values()
    assert chunked["loss"] == pytest.approx(float32["loss"], abs=1e-5)
    assert chunked["entropy"] == pytest.approx(float32["entropy"], abs=1e-5)
    # bfloat16: the backward GEMMs in bfloat16, summed in another order
    assert chunked["grad_norm"] == pytest.approx(float32["grad_norm"], rel=1e-5 if dtype == "float32" else 1e-2)
    assert max(float((a - b).abs().max()) for a, b in zip(chunked_weights, float32_weights)) < 1e-5 * (
        1 if dtype == "float32" else 100)


def test_compiled_decoder_blocks_train_as_eager_ones(make_config):
    """`trainer.compile = true` on CPU: each decoder block compiled (inductor), the same step within float32
    fusion rounding, with no recompilation per micro-batch (the packed attention runs eagerly inside)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # eager FlexAttention in other tests counts graphs too
    results = {}
    for compile_ in (False, True):
        config = make_config(compile=compile_)
        trainer = Trainer(config, storage_for(config))
        assert trainer.compiled is compile_
        metrics = [trainer.optimizer_step(step, make_batch(100 + step)) for step in range(2)]
        results[compile_] = metrics, [p.detach().clone() for p in trainer.module.parameters()]
    (eager, eager_weights), (compiled, compiled_weights) = results.values()
    for a, b in zip(eager, compiled):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["micro_batches"] > 1
    assert max(float((a - b).abs().max()) for a, b in zip(eager_weights, compiled_weights)) < 1e-4
    # one graph for every block, micro-batch and step: no frame of the decoder block compiled twice
    counters = torch._dynamo.utils.counters
    assert 1 <= counters["stats"]["unique_graphs"] <= 4 and not counters["recompiles"]


def test_compile_auto_is_on_for_cuda_in_one_process_only():
    from trace_rl.trainer.trainer import choose_compile

    assert choose_compile("auto", "cuda", False)[0] is True
    assert choose_compile("auto", "cpu", False)[0] is False
    assert choose_compile("auto", "cuda", True)[0] is False
    assert choose_compile(True, "cpu", False) == (True, "trainer.compile says so")
    assert choose_compile(False, "cuda", False)[0] is False


def test_the_bfloat16_math_mode_is_taken_only_where_nothing_samples_beside_the_trainer(make_config):
    from trace_rl.trainer.trainer import takes_bfloat16_gemms

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    alone = make_config()
    assert takes_bfloat16_gemms(alone, cpu, torch.bfloat16)
    assert not takes_bfloat16_gemms(alone, cpu, torch.float32)  # float32 values would be rounded
    assert not takes_bfloat16_gemms(alone, cpu, torch.float16)  # so would float16 ones
    assert not takes_bfloat16_gemms(alone, cuda, torch.bfloat16)  # CUDA has its GEMM with a float32 output
    beside = alone.model_copy(update={"async_": alone.async_.model_copy(update={"max_off_policy_steps": 1})})
    assert not takes_bfloat16_gemms(beside, cpu, torch.bfloat16)  # sampling runs in this process's other thread
    in_workers = beside.model_copy(update={"trainer": beside.trainer.model_copy(update={"cpu_offload": True})})
    assert in_workers.trainer.uses_workers and takes_bfloat16_gemms(in_workers, cpu, torch.bfloat16)


@pytest.mark.parametrize("max_norm", [0.1, 1000.0], ids=["clipped", "within"])
def test_clipping_by_the_fused_adamw_s_grad_scale_steps_as_clip_grad_norm(max_norm):
    """A compute copy's step clips in its fused AdamW's pass (`clip_in_fused_adamw`): the same weights as
    `clip_grad_norm_` and then the step, within float32 rounding, over steps whose gradients differ in scale."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 32), torch.randn(300)]
    runs = {}
    for way in ("clip_grad_norm_", "grad_scale"):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
        norms = []
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator) * (step + 1)
            if way == "grad_scale":
                norms.append(float(clip_in_fused_adamw(optimizer, params, max_norm)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
            optimizer.step()
        runs[way] = params, norms
    (clipped, norms), (scaled, scaled_norms) = runs.values()
    assert scaled_norms == pytest.approx(norms, rel=1e-6)
    assert min(norms) > max_norm if max_norm < 1 else max(norms) < max_norm  # every step clipped, or none
    assert max(float((a - b).abs().max()) for a, b in zip(clipped, scaled)) < 1e-6
    assert max(float((a - w).abs().min()) for a, w in zip(clipped, weights)) > 0  # the steps moved every weight


def test_the_fused_clip_s_norm_is_the_float64_norm_of_large_gradients():
    """`clip_in_fused_adamw`'s norm (BLAS dot products of pieces, summed in float64) is within 1e-6 of the float64
    norm over millions of values (`get_total_norm`'s float32 sums were 2.3e-4 off for these on the AMX Xeon,
    bench/RESULTS-bf16.md run 11; one dot product per gradient 2.9e-5 off on a Zen 5)."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (8_000_000, 300)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    exact = sum(float((p.grad.double() ** 2).sum()) for p in params) ** 0.5
    optimizer = torch.optim.AdamW(params, fused=True)
    assert float(clip_in_fused_adamw(optimizer, params, 1.0)) == pytest.approx(exact, rel=1e-6)
    assert float(optimizer.grad_scale) == pytest.approx(exact + 1e-6, rel=1e-6)
