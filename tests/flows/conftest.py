"""Small run configs for the pipeline tests (the session's Prefect server is `prefect_api`, tests/conftest.py)."""

from __future__ import annotations


def small_config(storage: str, name: str, steps: int = 2, **overrides) -> dict:
    """A run that takes seconds on the hf sampler: 2 examples x 4 rollouts of reverse-text per step."""
    data = {
        "name": name, "steps": steps, "seed": 3, "storage": storage,
        "inference": {"backend": "hf"},
        "sampling": {"max_completion_tokens": 8},
        "env": [{"id": "reverse-text", "batch_size": 2, "group_size": 4}],
        "trainer": {"lr": 1e-3, "micro_batch_tokens": 1024},  # inference.max_model_len's default
    }
    for key, value in overrides.items():
        data[key] = value
    return data
