"""Packing: first-fit-decreasing bins, sample isolation inside a packed row, temperature, too-long samples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.trainer.conftest import make_batch
from trace_rl.trainer.packing import PackingError, assign_to_ranks, collate, first_fit_decreasing, pack
from trace_rl.trainer.trainer import token_logprobs


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="sdpa").eval()


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


def test_logits_are_divided_by_the_sample_temperature(model):
    sample = dataclasses.replace(make_batch(3, n=1)[0], temperature=0.5)
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    with torch.no_grad():
        lp, _ = token_logprobs(model, collate([sample]), torch.device("cpu"))
        logits = model(input_ids=ids[None]).logits[0]
    expected = torch.log_softmax(logits[:-1] / 0.5, -1).gather(-1, ids[1:, None]).squeeze(-1)
    torch.testing.assert_close(lp[1:], expected, atol=1e-5, rtol=0)
    assert lp[0] == 0.0
    plain = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
    assert (lp[1:] - plain).abs().max() > 1e-3


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
