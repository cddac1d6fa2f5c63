"""trace-rl: RL post-training on token-exact traces.

The names an extension or a notebook imports live here, at the top: `from trace_rl import Trace, Algorithm,
register, Environment, register_env`. Where they are defined may move; these names do not (removing one is a
decision: tests/test_public_api.py pins `__all__`). Each is imported on first use (PEP 562), so that a process
that runs one module (`python -m trace_rl.machine.reaper`, a trainer worker) imports none of the others.
"""

from importlib import import_module

__version__ = "0.1.0"

PUBLIC = {
    # the data model
    **dict.fromkeys(["Branch", "Message", "Trace", "group_traces"], "trace_rl.data.trace"),
    "Channel": "trace_rl.data.channel",
    "TrainingSample": "trace_rl.data.sample",
    # algorithms
    **dict.fromkeys(["Algorithm", "AlgorithmConfig", "AlgorithmError", "load_algorithm", "register"],
                    "trace_rl.algorithms"),
    **dict.fromkeys(["load_algorithms", "run_algorithm", "run_algorithms"], "trace_rl.algorithms.runner"),
    # environments
    **dict.fromkeys(["EnvError", "Environment", "Example", "Sampler", "load_env", "register_env"], "trace_rl.envs"),
    # channels: checked against their branches, aggregated, stored
    **dict.fromkeys(["DimensionError", "validate_channels"], "trace_rl.data.validate"),
    **dict.fromkeys(["aggregate", "channel_stats"], "trace_rl.pipeline.channels"),
    **dict.fromkeys(["read_channels", "write_channels"], "trace_rl.tables"),
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> object:
    if name not in PUBLIC:
        raise AttributeError(f"module 'trace_rl' has no attribute {name!r}")
    value = getattr(import_module(PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
