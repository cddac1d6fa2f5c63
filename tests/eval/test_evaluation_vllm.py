"""Eval on the shared vLLM engine, between training steps, without the orchestrator: training's weights stay
bitwise the same (the Prefect-flow version of this on the transformers sampler is tests/flows/test_eval.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bitwise import difference
from tests.conftest import VLLM_OVERRIDES
from tests.flows.conftest import small_config
from trace_rl.config import apply_override
from trace_rl.runs.loading import validate_config

EVAL = {"k": 2, "num_examples": 2, "interval": 2, "envs": [{"id": "reverse-text"}]}


def vllm_config(storage: Path, name: str, **overrides):
    data = small_config(str(storage), name, steps=4, ckpt={"keep": 4}, **overrides)  # every step's weights stay
    for assignment in VLLM_OVERRIDES:
        apply_override(data, assignment)
    return validate_config(data)


@pytest.mark.vllm
def test_eval_between_steps_on_vllm_leaves_the_weights_bitwise_identical(tmp_path, shared_vllm):
    from trace_rl.eval.evaluation import evaluate, evaluates_at
    from trace_rl.pipeline.session import Session
    from trace_rl.aio import run_sync
    from trace_rl.pipeline.step import run_step

    weights = {}
    for name, overrides in (("plain", {}), ("evaluated", {"eval": EVAL})):
        session = Session(vllm_config(tmp_path, name, **overrides))
        assert session.config.inference.backend == "vllm"
        for step in range(1, 5):
            run_step(session, step)
            if evaluates_at(session.config, step):
                rows = run_sync(evaluate(session, step))["metrics"]
                assert rows[0]["step"] == step and rows[0]["error_fraction"] == 0.0
        weights[name] = [Path(session.storage.path("weights", f"{s:06d}", "model.safetensors")).read_bytes()
                         for s in range(1, 5)]
    assert [difference(*pair) for pair in zip(weights["plain"], weights["evaluated"])] == [None] * 4
