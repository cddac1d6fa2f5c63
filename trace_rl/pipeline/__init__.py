"""One training step's stages as plain functions (docs/pipeline.md), the per-process session that keeps
the models and the trainer warm between steps, and which engines a run starts.

The plumbing under the stages, for a notebook or a tool that drives them itself: `load_algorithms` and
`apply_algorithms` (a list of algorithms over traces), `validate_channels` (`DimensionError`), `sum_channels`
(one training sample per branch), `channel_stats`, and the channel tables (`read_channels`, `write_channels`).
"""

from trace_rl.algorithms.runner import apply_algorithms, load_algorithms
from trace_rl.data.validate import DimensionError, validate_channels
from trace_rl.pipeline.channels import channel_stats, sum_channels
from trace_rl.tables import read_channels, write_channels

__all__ = ["DimensionError", "apply_algorithms", "channel_stats", "load_algorithms", "read_channels", "sum_channels",
           "validate_channels", "write_channels"]
