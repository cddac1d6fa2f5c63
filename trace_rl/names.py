"""Names every layer shares, defined once; this module imports nothing from trace_rl.

- `POLICY`: the model key of the trained model (`[model]`); other models are `[models.<key>]`.
- Losses (channel kinds): an algorithm's channel feeds exactly one loss.
  - `rl`: values are per-token advantages A_t, trained by the importance-weighted policy gradient;
  - `ce`: values are per-token weights w_t, trained by weighted cross-entropy (negative log-likelihood).
  Same-loss channels of a branch are summed into one training sample (`channels.sum_channels`), and
  `batch.parquet` has one `<loss>_values` / `<loss>_mask` column pair per loss.
"""

from __future__ import annotations

from typing import Literal

POLICY = "policy"

Loss = Literal["rl", "ce"]
LOSS_NAMES: tuple[Loss, ...] = ("rl", "ce")
