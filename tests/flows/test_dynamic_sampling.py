"""Dynamic sampling end to end on the hf backend: the step trains on the kept groups and reports the drop."""

from __future__ import annotations

import pyarrow.parquet as pq

from tests.flows.conftest import small_config
from trace_rl.runs.loading import validate_config
from trace_rl.storage import RunStorage


def test_a_step_with_dynamic_sampling_trains_on_the_kept_groups_and_reports_them(prefect_api, tmp_path):
    from flows.train import run_training

    data = small_config(str(tmp_path), "dynamic", steps=1)
    data["env"][0].update(drop_uniform_groups=True, refill_rounds=2)
    config = validate_config(data)
    run_training(config)
    storage = RunStorage(config.storage, config.name)
    metrics = storage.read_json(storage.step_path(1, "metrics.json"))
    kept, dropped = metrics["rollouts/reverse-text/groups"], metrics["rollouts/reverse-text/dropped_groups"]
    assert metrics["rollouts/reverse-text/traces"] == 4 * (kept + dropped)
    assert 0 <= metrics["rollouts/reverse-text/refill_rounds"] <= 2
    traces = pq.read_table(storage.fs.open(storage.step_path(1, "traces.parquet"), "rb")).to_pydict()
    rewards: dict[str, set] = {}
    for group, reward in zip(traces["group_id"], traces["reward"]):
        rewards.setdefault(group, set()).add(reward)
    assert len(rewards) == kept and all(len(r) > 1 for r in rewards.values())
