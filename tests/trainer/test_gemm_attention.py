"""A half-precision row's attention on CPU (`GemmAttention`): the float32 attention of its values, rounded once."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_prefix_tree import branch_of_branch_tree, long_prompt_tree, shared_batch
from trace_rl.trainer.prefix_tree import build_tree
from trace_rl.trainer.varlen import packed_sdpa_attention


def tree_named(name: str):
    if name == "unshared":
        return build_tree([s.input_ids for s in shared_batch()], share=False)
    return long_prompt_tree() if name == "long prompt" else branch_of_branch_tree()


@pytest.mark.parametrize("tree", ["branch of a branch", "long prompt", "unshared"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype, half_ulp", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11)])
def test_a_half_precision_row_attends_as_float32_rounded_once(tree, heads, kv_heads, dtype, half_ulp):
    """Outputs and q/k/v gradients are the float32 attention's (torch's SDPA on the same values in float32, the
    packed path the float32 test checks against each sample alone) rounded once to the half dtype: within half a
    unit in the last place (relative: 2^-8 in bfloat16), and a few float32 roundings. A shared context's keys sum
    their slots' gradients in float32 before that one rounding."""
    tree = tree_named(tree)
    torch.manual_seed(0)
    length = len(tree.row_ids)
    q, k, v = (torch.randn(1, n, length, 32).to(dtype).requires_grad_() for n in (heads, kv_heads, kv_heads))
    reference = [x.detach().float().requires_grad_() for x in (q, k, v)]
    weights = torch.randn(1, length, heads, 32).to(dtype).float()  # the same upstream gradient, exact in both
    outputs = []
    for inputs in ((q, k, v), reference):
        out, _ = packed_sdpa_attention(None, *inputs, None, row_layout=tree.layout, scaling=0.2)
        (out.float() * weights).sum().backward()
        outputs.append(out)
    out, expected = outputs
    assert out.dtype == dtype and out.shape == (1, length, heads, 32)
    for got, want in ((out, expected), *((x.grad, r.grad) for x, r in zip((q, k, v), reference))):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.detach(), rtol=half_ulp * 1.01, atol=1e-5)
    assert float(k.grad.abs().max()) > 1e-2
