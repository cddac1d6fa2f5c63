"""Synthetic training batches and trainer configs on the tiny model."""

from __future__ import annotations

import numpy as np
import pytest

from trace_rl.config import Config
from trace_rl.data.sample import TrainingSample
from trace_rl.storage import RunStorage

VOCAB = 256  # byte tokens of the tiny model


def make_sample(rng: np.random.Generator, name: str, length: int, temperature: float = 1.0) -> TrainingSample:
    """Random tokens; the second half is 'sampled': rl on some samples' tokens, ce on others'."""
    completion = np.arange(length) >= length // 2
    use_ce = rng.random() < 0.3
    rl_mask = completion & (not use_ce) & (rng.random(length) < 0.9)
    ce_mask = completion & use_ce
    return TrainingSample(
        trace_id=name,
        branch_index=0,
        env="synthetic",
        input_ids=rng.integers(0, VOCAB, length).astype(np.int32),
        temperature=temperature,
        sampled=completion,
        inference_logprobs=np.where(completion, -rng.uniform(4.5, 7.0, length), 0.0).astype(np.float32),
        rl_values=np.where(rl_mask, rng.normal(0, 1, length), 0.0).astype(np.float32),
        rl_mask=rl_mask,
        ce_values=ce_mask.astype(np.float32),
        ce_mask=ce_mask,
    )


def make_batch(seed: int, n: int = 8, min_len: int = 6, max_len: int = 40) -> list[TrainingSample]:
    rng = np.random.default_rng(seed)
    return [
        make_sample(rng, f"trace-{seed}-{i}", int(rng.integers(min_len, max_len + 1)), float(rng.choice([1.0, 0.7])))
        for i in range(n)
    ]


@pytest.fixture
def make_config(tiny_model_path, tmp_path):
    def build(name: str = "run", **trainer) -> Config:
        options = {"lr": 1e-3, "micro_batch_tokens": 64, "device": "cpu", "warmup_steps": 2, **trainer}
        return Config(  # no sample is longer than a micro-batch: synthetic batches (make_batch) are short
            name=name, storage=str(tmp_path / "runs"), env=[{"id": "synthetic"}], model={"name": tiny_model_path},
            inference={"max_model_len": options["micro_batch_tokens"]}, trainer=options,
        )

    return build


def storage_for(config: Config) -> RunStorage:
    return RunStorage.of(config)
