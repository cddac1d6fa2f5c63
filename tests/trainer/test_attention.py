"""The packed attentions compute the same attention: one FlexAttention call over the prefix tree's paths
(`packed_flex`) equals one padded SDPA over the segments (`packed_sdpa`), forward on CPU (torch has no
FlexAttention backward there; both directions on CUDA in bench.gpu_check); and which one `trainer.attention`
picks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from tests.trainer.test_prefix_tree import branch_of_branch_tree, shared_batch
from trace_rl.config import Config
from trace_rl.trainer.attention import choose_attention
from trace_rl.trainer.packing import collate
from trace_rl.trainer.prefix_tree import build_tree
from trace_rl.trainer.trainer import token_logprobs
from trace_rl.trainer.tree_attention import TREE_ATTENTION, packed_flex_attention, path_tables, tree_block_mask
from trace_rl.trainer.varlen import PACKED_ATTENTION, packed_sdpa_attention

# on CPU FlexAttention runs its unfused reference (the compiled kernel is CUDA's): what these tests compare
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def test_the_path_tables_hold_each_sample_path():
    """A row position is on a sample's path iff it is in its segment's context or an earlier own position."""
    tree = branch_of_branch_tree()
    length = len(tree.row_ids)
    segment, context = path_tables(tree.layout, length)
    for path in tree.paths:
        last = path[-1]
        seen = np.flatnonzero(context[segment[last]] | ((segment == segment[last]) & (np.arange(length) <= last)))
        assert seen.tolist() == path.tolist()


@pytest.mark.parametrize("tree", ["branch of a branch", "shared batch", "unshared"])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (3, 3, 8)])
def test_flex_attention_equals_the_padded_sdpa(tree, heads, kv_heads, dim):
    if tree == "branch of a branch":
        tree = branch_of_branch_tree()
    else:
        tree = build_tree([s.input_ids for s in shared_batch()], share=tree == "shared batch")
    torch.manual_seed(0)
    length = len(tree.row_ids)
    q, k, v = (torch.randn(1, h, length, dim) for h in (heads, kv_heads, kv_heads))
    scale = 0.3
    per_segment, _ = packed_sdpa_attention(None, q, k, v, None, scaling=scale, row_layout=tree.layout)
    flex, _ = packed_flex_attention(None, q, k, v, None, scaling=scale, row_layout=tree.layout)
    assert flex.shape == per_segment.shape == (1, length, heads, dim)
    torch.testing.assert_close(flex, per_segment, atol=1e-6, rtol=0)
    # against each sample attending alone: the comparison sees a wrong path
    for path in tree.paths:
        index = torch.from_numpy(path)
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, index], k[:, :, index], v[:, :, index], is_causal=True, scale=scale, enable_gqa=True)
        torch.testing.assert_close(flex[:, index], alone.transpose(1, 2), atol=1e-6, rtol=0)


def test_the_tiny_model_gives_the_same_logprobs_through_either_attention(tiny_model_path):
    from transformers import AutoModelForCausalLM

    batch = collate(shared_batch(), share=True)
    results = {}
    for attention in (PACKED_ATTENTION, TREE_ATTENTION):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32,
                                                     attn_implementation=attention).eval()
        with torch.no_grad():
            results[attention] = token_logprobs(model, batch, torch.device("cpu"))
        if attention == TREE_ATTENTION:
            # one block mask for the micro-batch's layout, read by every layer (the tiny model has 2)
            assert model.config.num_hidden_layers > 1
            assert [key[0] for key in batch.layout._cache].count("block_mask") == 1
    (lp_sdpa, entropy_sdpa), (lp_flex, entropy_flex) = results.values()
    assert (lp_sdpa != 0).sum() > 100
    torch.testing.assert_close(lp_flex, lp_sdpa, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy_flex, entropy_sdpa, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tree", ["branch of a branch", "shared batch", "unshared", "long"])
def test_the_block_mask_is_create_block_masks(tree):
    """Built from per-block visibility, the block mask is the one `create_block_mask` evaluates from `sees`: the
    same partial and full blocks and the same dense mask (a row of 300+ positions spans several blocks)."""
    if tree == "branch of a branch":
        tree = branch_of_branch_tree()
    elif tree == "long":
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 50, 200)
        tree = build_tree([np.concatenate([prompt, rng.integers(0, 50, n)]) for n in (90, 130, 7)], share=True)
    else:
        tree = build_tree([s.input_ids for s in shared_batch()], share=tree == "shared batch")
    length = len(tree.row_ids)
    segment, context = (torch.from_numpy(table) for table in path_tables(tree.layout, length))

    def sees(batch, head, q, k):
        return context[segment[q], k] | ((segment[k] == segment[q]) & (k <= q))

    mine = tree_block_mask(tree.layout, length, torch.device("cpu"))
    theirs = create_block_mask(sees, None, None, length, length, device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name))
    assert torch.equal(mine.to_dense(), theirs.to_dense())


def test_auto_takes_flex_on_cuda_and_packed_sdpa_elsewhere():
    assert choose_attention("auto", "cuda")[0] == TREE_ATTENTION
    assert choose_attention("auto", "cpu")[0] == PACKED_ATTENTION
    assert choose_attention(PACKED_ATTENTION, "cuda")[0] == PACKED_ATTENTION
    assert choose_attention(TREE_ATTENTION, "cuda") == (TREE_ATTENTION, "trainer.attention says so")
    with pytest.raises(ValueError, match=r"trainer.attention = 'packed_flex' needs CUDA .* set trainer.attention"):
        choose_attention(TREE_ATTENTION, "cpu")


def test_flex_on_a_cpu_trainer_is_refused_at_the_config():
    with pytest.raises(ValueError, match=r"trainer.attention = 'packed_flex' needs CUDA"):
        Config(env=[{"id": "synthetic"}], trainer={"device": "cpu", "attention": "packed_flex"})
