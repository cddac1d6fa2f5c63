"""bench/trl_real.py end to end on the tiny model: both sides run interleaved, every figure the report needs is there."""

from __future__ import annotations

import pytest

from bench import trl


@pytest.mark.slow
def test_the_real_model_comparison_runs_on_the_tiny_model(monkeypatch):
    from bench import trl_real
    from bench.run_all import render_trl_real, targets

    monkeypatch.setenv("BENCH_REAL_MODEL", "tiny")  # the sides' processes read it as they import bench.trl
    monkeypatch.setitem(trl.REAL, "model", "tiny")
    result = trl_real.run(steps=2, sides=("trace-rl-hf", "trl-hf"))
    ours, theirs = result["sides"]["trace-rl-hf"], result["sides"]["trl-hf"]
    assert "error" not in ours and "error" not in theirs, result["sides"]
    for side in (ours, theirs):
        assert len(side["rewards"]) == 2 and side["sampling_tokens_per_s"] > 0 and side["trainer_tokens_per_s"] > 0
        # not compared with peak_rss_mb: a side's ru_maxrss starts from its launcher's (Linux keeps it across exec),
        # which a long pytest session makes GBs
        assert side["peak_tree_rss_mb"] > 0 and side["peak_rss_mb"] > 0
        assert 0 < side["completion_tokens_per_step"] < side["tokens_per_step"]
    assert theirs["mixed_precision"] == ("bf16" if trl.REAL["dtype"] == "bfloat16" else "no")
    # trace-rl's checkpoint of step 1 was written in the background, during its step 2; its synchronous cost measured
    assert len(ours["background_write_seconds"]) == 2 and ours["sync_checkpoint_seconds"] > 0
    assert {"sample_rollouts", "trainer/compute", "trainer/checkpoint"} <= set(ours["median_stage_seconds"])
    assert set(result["floors"]) == {"trace-rl-hf", "trl-hf"} and result["parameters"] > 0
    text = "\n".join(render_trl_real(result))
    assert "| trace-rl-hf |" in text and "| trl-hf |" in text and "checkpoint:" in text
    assert any("both transformers generate" in row[0] for row in targets({"trl-real": {"result": result}}))
