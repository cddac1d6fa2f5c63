"""Packing: first-fit-decreasing bins, sample isolation inside a packed row, temperature, too-long samples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.trainer.conftest import make_batch
from trace_rl.trainer.packing import PackingError, assign_to_ranks, collate, first_fit_decreasing, pack
from trace_rl.trainer.trainer import chunk_positions, token_logprobs
from trace_rl.trainer.varlen import PACKED_ATTENTION


def load_model(path: str, attention: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).eval()


@pytest.fixture(scope="module", params=[PACKED_ATTENTION, "sdpa"])
def model(tiny_model_path, request):
    """The trainer's per-sample attention, and transformers' sdpa (its block mask built from the position ids)."""
    return load_model(tiny_model_path, request.param)


def test_first_fit_decreasing():
    # longest first: 6 -> bin0, 5 -> bin1, 4 -> bin2, 3 -> bin1 (full), 2 -> bin0 (full)
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]


def test_pack_respects_the_limit_and_keeps_every_token():
    samples = make_batch(0, n=12)
    batches = pack(samples, 64)
    assert all(b.num_tokens <= 64 for b in batches)
    assert sum(b.num_tokens for b in batches) == sum(len(s) for s in samples)
    assert len(batches) == len(first_fit_decreasing([len(s) for s in samples], 64))


def test_positions_restart_and_first_token_masks_are_dropped():
    samples = make_batch(1, n=2)
    for s in samples:
        s.ce_mask[0] = True
    batch = collate(samples)
    n0 = len(samples[0])
    assert batch.position_ids[:n0].tolist() == list(range(n0))
    assert batch.position_ids[n0:].tolist() == list(range(len(samples[1])))
    assert not batch.ce_mask[0] and not batch.ce_mask[n0]


def test_packed_logprobs_equal_each_sample_alone(model):
    samples = make_batch(2, n=4, min_len=10, max_len=30)
    packed = collate(samples)
    with torch.no_grad():
        lp_packed, entropy_packed = token_logprobs(model, packed, torch.device("cpu"))
        alone = [token_logprobs(model, collate([s]), torch.device("cpu")) for s in samples]
    torch.testing.assert_close(lp_packed, torch.cat([lp for lp, _ in alone]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy_packed, torch.cat([e for _, e in alone]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", ["auto", None])
def test_packed_varlen_loss_and_gradients_equal_the_unpacked_computation(tiny_model_path, chunk_size):
    """The trainer's per-sample attention over a packed row gives each sample's own loss and gradients (1e-5)."""
    model = load_model(tiny_model_path, PACKED_ATTENTION).train()
    samples = make_batch(4, n=5, min_len=3, max_len=40)
    weights = torch.from_numpy(np.random.default_rng(0).normal(size=sum(len(s) for s in samples)).astype(np.float32))

    def loss_and_gradients(batches):
        model.zero_grad(set_to_none=True)
        lp = torch.cat([token_logprobs(model, b, torch.device("cpu"), chunk_size)[0] for b in batches])
        loss = -(lp * weights).sum()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    packed_loss, packed_grads = loss_and_gradients([collate(samples)])
    alone_loss, alone_grads = loss_and_gradients([collate([s]) for s in samples])
    torch.testing.assert_close(packed_loss, alone_loss, atol=1e-5, rtol=0)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], atol=1e-5, rtol=0, msg=name)
    assert max(g.abs().max() for g in packed_grads.values()) > 1e-2  # gradients that say something


def test_sampled_tokens_at_the_sample_temperature_others_at_one(model):
    """A sampled token's logprob is at the branch's temperature; a token nothing sampled (a prompt, or a user/tool
    observation trained by a ce channel such as echo) is the model's own logprob, at temperature 1."""
    sample = dataclasses.replace(make_batch(3, n=1, min_len=16, max_len=16)[0], temperature=0.5)
    n = len(sample)
    # tokens 0-5 prompt, 6-9 sampled, 10-12 a tool observation trained by ce, 13-15 sampled again
    sampled = np.isin(np.arange(n), [6, 7, 8, 9, 13, 14, 15])
    ce_mask = np.isin(np.arange(n), [10, 11, 12])
    sample = dataclasses.replace(sample, sampled=sampled, ce_mask=ce_mask, ce_values=ce_mask.astype(np.float32),
                                 rl_mask=sampled.copy(), rl_values=sampled.astype(np.float32))
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    with torch.no_grad():
        lp, entropy = token_logprobs(model, collate([sample]), torch.device("cpu"))
        logits = model(input_ids=ids[None]).logits[0, :-1]
    at_t = torch.log_softmax(logits / 0.5, -1).gather(-1, ids[1:, None]).squeeze(-1)
    at_1 = torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
    expected = torch.where(torch.from_numpy(sampled[1:]), at_t, at_1)
    torch.testing.assert_close(lp[1:], expected, atol=1e-5, rtol=0)
    assert lp[0] == 0.0
    # the ce observation tokens 10-12 sit at temperature 1, and that differs from temperature 0.5
    torch.testing.assert_close(lp[10:13], at_1[9:12], atol=1e-5, rtol=0)
    assert (at_t[9:12] - at_1[9:12]).abs().min() > 1e-3
    torch.testing.assert_close(lp[6:10], at_t[5:9], atol=1e-5, rtol=0)
    # the entropy follows the same rule
    p1 = torch.softmax(logits[9], -1)
    assert entropy[10].item() == pytest.approx(-(p1 * p1.log()).sum().item(), abs=1e-4)


def test_an_output_layer_chunk_is_sized_by_logits_per_device_type():
    """2^24 logits a chunk on a CPU (and any device without its own size), 2^29 on CUDA; at least one position."""
    qwen = 151_936
    assert chunk_positions(qwen) == chunk_positions(qwen, "cpu") == chunk_positions(qwen, "mps") == 110
    assert chunk_positions(qwen, "cuda") == 3_533
    assert chunk_positions(2**30, "cpu") == 1


def test_chunked_logprobs_equal_the_full_logits_path_with_gradients(model):
    """The chunked output layer (recomputed in backward) gives the full-logits numbers and gradients within 1e-5."""
    samples = make_batch(11, n=5, min_len=20, max_len=40)
    batch = collate(samples)
    weights = torch.from_numpy(np.random.default_rng(0).normal(size=batch.num_tokens).astype(np.float32))
    results = {}
    for chunk_size in (None, 7, 64, 4096):
        model.zero_grad(set_to_none=True)
        lp, entropy = token_logprobs(model, batch, torch.device("cpu"), chunk_size=chunk_size)
        (weights * lp).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[chunk_size] = (lp.detach(), entropy, grads)
    model.zero_grad(set_to_none=True)
    lp_full, entropy_full, grads_full = results[None]
    assert entropy_full.requires_grad is False
    for chunk_size in (7, 64, 4096):
        lp, entropy, grads = results[chunk_size]
        torch.testing.assert_close(lp, lp_full, atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, entropy_full, atol=1e-5, rtol=0)
        assert grads.keys() == grads_full.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], grads_full[name], atol=1e-5, rtol=1e-4)
    assert max(g.abs().max().item() for g in grads_full.values()) > 1e-3


def test_a_one_token_row_still_runs_backward(model):
    """What a rank without work runs so its collectives match: a 1-token row, attached to the graph, zero gradient."""
    from trace_rl.trainer.packing import empty_micro_batch

    lp, entropy = token_logprobs(model, empty_micro_batch(), torch.device("cpu"))
    assert lp.tolist() == [0.0] and entropy.tolist() == [0.0] and lp.requires_grad
    model.zero_grad(set_to_none=True)
    lp.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_too_long_sample_is_named():
    short, long = make_batch(4, n=2, min_len=5, max_len=5)[0], make_batch(4, n=1, min_len=12, max_len=12)[0]
    long = dataclasses.replace(long, trace_id="the-long-one", branch_index=2)
    with pytest.raises(PackingError, match=r"'the-long-one' branch 2 has 12 tokens.*trainer.truncate"):
        pack([short, long], 9)


def test_truncate_cuts_every_array_in_step():
    sample = make_batch(5, n=1, min_len=30, max_len=30)[0]
    (batch,) = pack([sample], 20, truncate=True)
    assert batch.num_tokens == 20
    assert batch.input_ids.tolist() == sample.input_ids[:20].tolist()
    for name in ("rl_mask", "ce_mask", "rl_values", "ce_values", "inference_logprobs"):
        assert getattr(batch, name)[1:].tolist() == getattr(sample, name)[1:20].tolist()


def test_ranks_get_balanced_work_and_equal_micro_batch_counts():
    batches = pack(make_batch(6, n=9, min_len=5, max_len=60), 64)
    ranks = assign_to_ranks(batches, 2)
    assert len(ranks[0]) == len(ranks[1])
    loads = [sum(b.num_tokens for b in r if b.rl_mask.any() or b.ce_mask.any() or b.num_tokens > 1) for r in ranks]
    assert abs(loads[0] - loads[1]) <= max(b.num_tokens for b in batches)
    (single,) = assign_to_ranks([], 1)
    assert len(single) == 1 and single[0].num_tokens == 1 and not single[0].rl_mask.any()
