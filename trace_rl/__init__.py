"""trace-rl: RL post-training on token-exact traces.

The names an algorithm, env or loss author imports live here, at the top: `from trace_rl import Trace, Algorithm,
register_algorithm, Environment, register_env, sampled_mask`. Where they are defined may move; these names do not
(tests/test_public_api.py pins `__all__`). The pipeline's own plumbing (reading and writing channel tables,
validating and summing channels) is `trace_rl.pipeline`'s.

Each name is imported on first use (PEP 562), so that a process that runs one module (`python -m
trace_rl.machine.reaper`, a trainer rank) imports none of the others; the `TYPE_CHECKING` block below names the same
objects for IDEs and type checkers.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from trace_rl.version import VERSION

__version__ = VERSION

PUBLIC = {
    # the data model
    **dict.fromkeys(["Branch", "Message", "Trace", "group_traces"], "trace_rl.data.trace"),
    "Channel": "trace_rl.data.channel",
    "TrainingSample": "trace_rl.data.sample",
    # algorithms
    **dict.fromkeys(["Algorithm", "AlgorithmError"], "trace_rl.algorithms.base"),
    "AlgorithmConfig": "trace_rl.config",
    "register_algorithm": "trace_rl.algorithms.registry",
    "load_algorithm": "trace_rl.algorithms.lookup",
    "apply_algorithm": "trace_rl.algorithms.runner",
    **dict.fromkeys(["ok_traces", "sampled_mask", "set_on_sampled"], "trace_rl.algorithms.signal"),
    # environments
    **dict.fromkeys(["EnvError", "Environment", "Example", "Sampler"], "trace_rl.envs.base"),
    "register_env": "trace_rl.envs.registry",
    "load_env": "trace_rl.envs.lookup",
    "Conversation": "trace_rl.models.render",
    "ModelRuntime": "trace_rl.models.runtime",
    "RetryableError": "trace_rl.errors",
    # policy losses
    **dict.fromkeys(["LossError", "register_loss"], "trace_rl.losses.registry"),
    **dict.fromkeys(["PolicyLoss", "PolicyTokens"], "trace_rl.losses.tokens"),
    # options of algorithms, envs and losses
    "NoOptions": "trace_rl.options",
}

__all__ = sorted(PUBLIC)

if TYPE_CHECKING:
    from trace_rl.algorithms.base import Algorithm, AlgorithmError
    from trace_rl.algorithms.lookup import load_algorithm
    from trace_rl.algorithms.registry import register_algorithm
    from trace_rl.algorithms.runner import apply_algorithm
    from trace_rl.algorithms.signal import ok_traces, sampled_mask, set_on_sampled
    from trace_rl.config import AlgorithmConfig
    from trace_rl.data.channel import Channel
    from trace_rl.data.sample import TrainingSample
    from trace_rl.data.trace import Branch, Message, Trace, group_traces
    from trace_rl.envs.base import EnvError, Environment, Example, Sampler
    from trace_rl.envs.lookup import load_env
    from trace_rl.envs.registry import register_env
    from trace_rl.errors import RetryableError
    from trace_rl.losses.registry import LossError, register_loss
    from trace_rl.losses.tokens import PolicyLoss, PolicyTokens
    from trace_rl.models.render import Conversation
    from trace_rl.models.runtime import ModelRuntime
    from trace_rl.options import NoOptions


def __getattr__(name: str):  # noqa: ANN202 - the type is the named object's (see the TYPE_CHECKING block)
    if name not in PUBLIC:
        raise AttributeError(f"module 'trace_rl' has no attribute {name!r}")
    value = getattr(import_module(PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
