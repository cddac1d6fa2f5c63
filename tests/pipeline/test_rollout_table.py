"""The rows of a step's rollout table (`[prefect.rollouts]`): which rollouts, their advantages as GRPO set them, texts
cut and secrets redacted. The table on a real Prefect server: tests/flows/test_pipeline.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.algorithms.helpers import chat_branch, make_trace, run
from trace_rl.algorithms import load_algorithm
from trace_rl.algorithms.runner import apply_algorithm
from trace_rl.config import ConfigError, parse_config
from trace_rl.pipeline.rollout_table import COLUMNS, choose, rollout_rows, shown

SECRET = "sk-live-0123456789abcdef"


def config(**rollouts):
    return parse_config({"name": "table", "seed": 5, "env": [{"id": "reverse-text", "args": {}}],
                         "prefect": {"rollouts": rollouts}})


def answer(trace_id, reward, group, prompt="reverse: abc", completion="cba", **kw):
    return make_trace(trace_id, [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                      [chat_branch([(0, 2, False), (1, 2, True)])], group=group, reward=reward, **kw)


def step_traces():
    """Three groups of four, rewards 0.1 apart within a group, and a failed trace with the step's best reward."""
    traces = [answer(f"{g}{i}", reward=g_index + i / 10, group=g, completion=f"answer {g}{i}")
              for g_index, g in enumerate("abc") for i in range(4)]
    return [*traces, answer("failed", 99.0, "a", error="timeout")]


def ids(rows):
    return [row["completion"].removeprefix("answer ") for row in rows]


def test_groups_shows_each_groups_best_worst_and_one_other_until_count():
    rows = rollout_rows(config(), 1, step_traces(), [])
    assert len(rows) == 8 and all(list(row) == list(COLUMNS) for row in rows)
    shown_ids = ids(rows)
    assert shown_ids[:2] == ["a3", "a0"] and shown_ids[3:5] == ["b3", "b0"] and shown_ids[6:] == ["c3", "c0"]
    assert shown_ids[2] in ("a1", "a2") and shown_ids[5] in ("b1", "b2")
    assert rollout_rows(config(), 1, step_traces(), []) == rows  # seeded by (seed, step): the same every time
    others = {tuple(ids(rollout_rows(config(), step, step_traces(), []))[i] for i in (2, 5)) for step in range(1, 9)}
    assert len(others) > 1  # ... and not the same one at every step


@pytest.mark.parametrize(("select", "expected"), [("best", ["c3", "c2", "c1"]), ("worst", ["a0", "a1", "a2"])])
def test_best_and_worst_are_the_steps_extremes_without_failed_traces(select, expected):
    assert ids(rollout_rows(config(count=3, select=select), 2, step_traces(), [])) == expected


def test_random_keeps_trace_order_and_count_is_capped_by_the_traces():
    picked = ids(rollout_rows(config(count=5, select="random"), 3, step_traces(), []))
    order = [t.id for t in step_traces()]
    assert len(set(picked)) == 5 and picked == sorted(picked, key=order.index)
    assert len(rollout_rows(config(count=100, select="random"), 3, step_traces(), [])) == 12
    assert choose(step_traces(), config(count=0).prefect.rollouts, None) == []


def test_advantage_is_the_summed_rl_value_and_empty_without_rl_channel():
    traces = step_traces()[:4]  # group a: rewards 0, 0.1, 0.2, 0.3
    channels = [c for algorithm in ("grpo", "grpo") for c in run(apply_algorithm(load_algorithm(algorithm), traces))]
    rows = rollout_rows(config(count=4, select="best"), 1, traces, channels)
    # two grpo channels summed: 2 * (r - 0.15)
    assert [(row["reward"], row["advantage"]) for row in rows] == [(0.3, 0.3), (0.2, 0.1), (0.1, -0.1), (0.0, -0.3)]
    sft = run(apply_algorithm(load_algorithm("sft"), traces))  # a ce channel: no advantage
    assert {row["advantage"] for row in rollout_rows(config(count=4), 1, traces, sft)} == {None}
    assert {row["policy_step"] for row in rows} == {0}
    assert {row["policy_versions"] for row in rows} == {"0"}  # not recorded: the trace's policy_step


def test_policy_versions_show_the_span_of_a_continued_rollout():
    trace = answer("continued", 1.0, "g", policy_step=3)
    branch = trace.branches[0]
    versions = np.full(len(branch), -1, np.int32)
    versions[branch.sampled] = np.linspace(2, 3, int(branch.sampled.sum())).round()
    branch.policy_versions = versions
    (row,) = rollout_rows(config(count=1), 4, [trace], [])
    assert (row["policy_step"], row["policy_versions"]) == (3, "2..3")


def test_the_last_turn_and_the_tool_calls_and_results_it_made_and_answered():
    trace = make_trace("multi", [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "1", "name": "forecast", "arguments": {"city": "Oslo"}},
            {"id": "2", "name": "forecast", "arguments": {"city": "Bergen"}}]},
        {"role": "tool", "content": "rain", "name": "forecast", "tool_call_id": "1"},
        {"role": "tool", "content": "sun", "tool_call_id": "2"}, {"role": "assistant", "content": "Mixed."},
        {"role": "user", "content": "thanks"}], [chat_branch([(1, 2, False), (2, 2, True)])], reward=1.0)
    (row,) = rollout_rows(config(count=1), 1, [trace], [])
    assert (row["prompt"], row["completion"]) == ("[tool result] forecast: rain\n[tool result]: sun", "Mixed.")
    trace.messages = trace.messages[:3]
    (row,) = rollout_rows(config(count=1), 1, [trace], [])
    assert (row["prompt"], row["completion"]) == (
        "weather?", 'Checking.\n[tool call] forecast {"city": "Oslo"}\n[tool call] forecast {"city": "Bergen"}')


def test_long_texts_are_cut_in_the_middle_to_max_chars():
    text = "START" + "x" * 1000 + "THE END"
    cut = shown(text, 60, ())
    assert len(cut) <= 60 and cut.startswith("START") and cut.endswith("THE END")
    assert "characters cut" in cut and shown("short", 60, ()) == "short"
    (row,) = rollout_rows(config(count=1, max_chars=100), 1, [answer("long", 1.0, "g", completion=text)], [])
    assert len(row["completion"]) <= 100 and row["completion"].endswith("END")


def test_no_secret_of_the_config_or_the_environment_reaches_a_row(monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", SECRET + "-env")
    monkeypatch.setenv("SHORT_KEY", "1")  # a flag named like a credential: no secret
    run_config = parse_config({
        "name": "table", "env": [{"id": "reverse-text"}], "storage": "s3://bucket/runs",
        "storage_options": {"key": "AKIA-EXAMPLE-ACCESS", "secret": SECRET}})
    leaked = answer("leak", 1.0, "g", prompt=f"use {SECRET} and AKIA-EXAMPLE-ACCESS",
                    completion=f"my key is {SECRET}-env, 1 + 1")
    (row,) = rollout_rows(run_config, 1, [leaked], [])
    assert row["prompt"] == "use [secret] and [secret]"
    assert row["completion"] == "my key is [secret], 1 + 1"


def test_the_table_options_are_checked_naming_the_key():
    with pytest.raises(ConfigError, match="prefect.rollouts.select"):
        config(select="top")
    with pytest.raises(ConfigError, match="prefect.rollouts.count"):
        config(count=-1)
