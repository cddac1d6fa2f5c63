"""trace-rl: RL post-training on token-exact traces.

The names an extension or a notebook imports live here, at the top: `from trace_rl import Trace, Algorithm,
register, Environment, register_env`. Where they are defined may move; these names do not (removing one is a
decision: tests/test_public_api.py pins `__all__`).
"""

from trace_rl.algorithms import Algorithm, AlgorithmConfig, AlgorithmError, load_algorithm, register
from trace_rl.algorithms.runner import load_algorithms, run_algorithm, run_algorithms
from trace_rl.data.channel import Channel
from trace_rl.data.sample import TrainingSample
from trace_rl.data.trace import Branch, Message, Trace, group_traces
from trace_rl.data.validate import DimensionError, validate_channels
from trace_rl.envs import EnvError, Environment, Example, Sampler, load_env, register_env
from trace_rl.pipeline.channels import aggregate, channel_stats
from trace_rl.tables import read_channels, write_channels

__version__ = "0.1.0"

__all__ = [
    # the data model
    "Branch", "Channel", "Message", "Trace", "TrainingSample", "group_traces",
    # algorithms
    "Algorithm", "AlgorithmConfig", "AlgorithmError", "load_algorithm", "load_algorithms", "register",
    "run_algorithm", "run_algorithms",
    # environments
    "EnvError", "Environment", "Example", "Sampler", "load_env", "register_env",
    # channels: checked against their branches, aggregated, stored
    "DimensionError", "aggregate", "channel_stats", "read_channels", "validate_channels", "write_channels",
]
