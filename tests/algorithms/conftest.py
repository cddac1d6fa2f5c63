"""Real tiny-model runtimes (in-process transformers) for the distillation algorithms."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def policy_runtime():
    from trace_rl.inference.hf import HFRuntime
    from trace_rl.models.runtime import RuntimeConfig

    return HFRuntime(RuntimeConfig(key="policy", name="tiny:0"))


@pytest.fixture(scope="module")
def reference_runtime():
    from trace_rl.inference.hf import HFRuntime
    from trace_rl.models.runtime import RuntimeConfig

    return HFRuntime(RuntimeConfig(key="reference", name="tiny:1"))
