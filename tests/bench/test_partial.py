"""bench/partial.py's workload: the long tail it claims, a reward that ranks completions, the config each side runs."""

from __future__ import annotations

import pytest

from bench.partial import SIDES, WORKLOAD, counting_reward, long_tail_rows, side_config
from trace_rl.pipeline.partial import check_partial


def test_one_prompt_in_eight_counts_to_a_long_n_and_each_step_gets_one():
    rows = long_tail_rows()
    lengths = [len(row["answer"].split(", ")) for row in rows]
    assert len(rows) == WORKLOAD["rows"] == 64
    for step in range(len(rows) // WORKLOAD["prompts_per_step"]):  # rows are not shuffled: a step is 8 in a row
        chunk = lengths[step * 8:(step + 1) * 8]
        assert sum(n >= 140 for n in chunk) == 1 and all(4 <= n <= 10 for n in chunk if n < 140)
    assert rows[0]["prompt"] == f"Count from 1 to {lengths[0]}, separated by commas."
    assert rows[0]["answer"].endswith(f", {lengths[0] - 1}, {lengths[0]}")
    # SmolLM2 writes a digit a token, then "," and " ": the longest count (n = 154, 662 tokens) fits the completion cap
    assert sum(len(str(x)) + 2 for x in range(1, max(lengths) + 1)) <= WORKLOAD["max_completion_tokens"] == 768


def test_the_reward_is_the_correct_prefix_over_n_or_the_numbers_written():
    answer = "1, 2, 3, 4, 5"
    assert counting_reward("Sure: 1, 2, 3, 4, 5.", answer) == 1.0
    assert counting_reward("1, 2, 3", answer) == 0.6  # stopped early
    assert counting_reward("1, 2, 3, 4, 5, 6, 7, 8, 9, 10", answer) == 0.5  # ran past n
    assert counting_reward("1, 2, 4, 5, 6", answer) == 0.4  # a wrong number ends the prefix
    assert counting_reward("I cannot count.", answer) == 0.0


def test_each_side_is_a_valid_run_and_only_partial_cuts_rollouts(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "{r["prompt"]}", "answer": "{r["answer"]}"}}\n' for r in long_tail_rows()))
    configs = {side: side_config(side, str(data), str(tmp_path / "runs"), steps=3) for side in SIDES}
    assert [c.async_.max_off_policy_steps for c in configs.values()] == [0, 1, 0, 1]
    assert [c.async_.partial_rollout_tokens for c in configs.values()] == [None, None, 256, 256]
    # a whole long count fits the cap, and the cap ends in 3 segments, the first 2 steps old on `partial` (its
    # max_token_age), 3 on `partial k=1` (beyond its default 2k: masked)
    assert [c.async_.token_age_bound for c in configs.values()] == [0, 2, 2, 2]
    assert all(c.sampling.max_completion_tokens == 768 == 3 * 256 for c in configs.values())
    # a whole 768-token completion on a loaded machine is not failed as a sampler timeout
    assert all(c.inference.request_timeout_s == 900 for c in configs.values())
    assert all(check_partial(c) == [] for c in configs.values())
    assert {c.steps for c in configs.values()} == {4}  # one step past the measured ones, never run


def test_the_sides_rows_summarize_and_render_side_by_side():
    """Two steps of made-up per-step rows through the module's summary, group comparison and RESULTS.md table."""
    from bench.partial import SIDES, compare_groups, summarize
    from bench.run_all import render_partial, targets

    def rows(step_seconds: float, rewards: tuple[float, float]) -> list[dict]:
        return [{"step": step, "wall": step_seconds * (3 if step == 1 else 1), "cpu": 1.0, "load": 2.0,
                 "metrics": {"batch/rl_tokens": 300.0, "time/sample_rollouts": 1.0, "time/train": 2.0,
                             "partial/rounds": 1.0, "rollouts/dataset/reward_mean": reward},
                 "groups": {f"step{step}-dataset-train-{i}-e0": {"reward": reward, "step": step, "long": i == 1,
                                                                  "completion_tokens": 10.0} for i in (1, 2)}}
                for step, reward in zip((1, 2), rewards)]

    sides = {"sync": summarize(rows(6.0, (0.2, 0.4))), "partial": summarize(rows(3.0, (0.3, 0.5)))}
    assert sides["sync"]["trained_tokens_per_s"] == 50.0 and sides["partial"]["trained_tokens_per_s"] == 100.0
    assert sides["partial"]["first_step_seconds"] == 9.0 and sides["partial"]["time"]["train"] == 2.0
    assert sides["sync"]["completion_tokens"] == {"long": 10.0, "short": 10.0}
    groups = compare_groups(sides)
    assert len(groups["rows"]) == 4 and groups["means"]["long"] == pytest.approx({"sync": 0.3, "partial": 0.4, "groups": 2})
    result = {"workload": WORKLOAD, "side_configs": {name: SIDES[name] for name in sides}, "steps": 2, "sides": sides,
              "ratios": {"partial / sync": {"trained_tokens_per_s": 2.0, "steps_per_s": 2.0}}, "groups": groups,
              "target": 1.5, "load_before": 1.0, "load_range": [2.0, 2.0]}
    text = "\n".join(render_partial(result))
    assert "partial: `max_off_policy_steps = 0`, `partial_rollout_tokens = 256`, `max_token_age = 2`." in text
    assert "| sync | 50.000 |" in text and "| partial | 100.000 |" in text and "| step1 | 0.20* 0.20 | 0.30* 0.30 |" in text
    assert targets({"partial": {"result": result}})[-1][1:] == ["2.00x", ">= 1.5x", True]
