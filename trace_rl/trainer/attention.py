"""`[trainer] attention`: which attention computes a packed micro-batch.

- `packed_sdpa` (`trace_rl.trainer.varlen`): one `scaled_dot_product_attention` per layer over the
  row's segments gathered into a padded batch (on CUDA in a half dtype, `varlen_attn` for a row that
  shares nothing). Runs everywhere; on CPU it is the only one with a backward.
- `packed_flex` (`trace_rl.trainer.tree_attention`): one compiled FlexAttention call per layer with
  a block mask of the prefix tree's paths. CUDA only: torch has no FlexAttention backward on CPU.
- `auto`: `packed_flex` on CUDA, `packed_sdpa` elsewhere.

Both compute the same attention (tests/trainer/test_attention.py; the backward on CUDA in
`bench.gpu_check`); both read a row of shared prefixes.
"""

from __future__ import annotations

from trace_rl.trainer.tree_attention import TREE_ATTENTION
from trace_rl.trainer.varlen import PACKED_ATTENTION

PACKED_ATTENTIONS = (PACKED_ATTENTION, TREE_ATTENTION)


def choose_attention(setting: str, device_type: str) -> tuple[str, str]:
    """The attention for `trainer.attention = setting` on a trainer device of `device_type` ("cuda", "cpu"), and
    why; a ValueError naming the key and the fix for `packed_flex` off CUDA."""
    if setting == TREE_ATTENTION and device_type != "cuda":
        raise ValueError(f"trainer.attention = {TREE_ATTENTION!r} needs CUDA (torch has no FlexAttention backward on "
                         f"{device_type}); set trainer.attention = 'auto' or {PACKED_ATTENTION!r}")
    if setting != "auto":
        return setting, "trainer.attention says so"
    if device_type == "cuda":
        return TREE_ATTENTION, "auto on CUDA: one FlexAttention call per layer"
    return PACKED_ATTENTION, f"auto on {device_type}: one padded SDPA per layer (no FlexAttention backward there)"
