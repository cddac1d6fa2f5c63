"""bench/partial.py's workload: the long tail it claims, a reward that ranks completions, the config each side runs."""

from __future__ import annotations

import pytest

from bench.partial import (
    SIDES,
    STORIES,
    WORKLOAD,
    counting_reward,
    long_tail_reward,
    long_tail_rows,
    side_config,
    story_reward,
)
from trace_rl.pipeline.partial import check_partial


def test_one_prompt_in_eight_asks_for_a_story_and_each_step_gets_one():
    rows = long_tail_rows()
    assert len(rows) == WORKLOAD["rows"] == 64
    for step in range(len(rows) // WORKLOAD["prompts_per_step"]):  # rows are not shuffled: a step is 8 in a row
        chunk = rows[step * 8:(step + 1) * 8]
        stories = [row for row in chunk if len(row["messages"]) == 1]
        assert stories == [chunk[0]] and chunk[0]["answer"] == STORIES[step][1]
        assert chunk[0]["messages"][0]["content"] == f"Write a story of about 600 words about {STORIES[step][0]}."
        counts = [len(row["answer"].split(", ")) for row in chunk[1:]]
        assert counts == [10, 9, 8, 7, 6, 5, 4]
        assert all(row["messages"][0] == {"role": "system", "content": WORKLOAD["system_prompt"]} for row in chunk[1:])
    assert rows[1]["messages"][1]["content"] == "Count from 1 to 10, separated by commas."
    assert rows[1]["answer"] == "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
    assert all(word in subject for subject, word in STORIES)


def test_the_count_reward_is_the_correct_prefix_over_n_or_the_numbers_written():
    answer = "1, 2, 3, 4, 5"
    assert counting_reward("Sure: 1, 2, 3, 4, 5.", answer) == 1.0
    assert counting_reward("1, 2, 3", answer) == 0.6  # stopped early
    assert counting_reward("1, 2, 3, 4, 5, 6, 7, 8, 9, 10", answer) == 0.5  # ran past n
    assert counting_reward("1, 2, 4, 5, 6", answer) == 0.4  # a wrong number ends the prefix
    assert counting_reward("I cannot count.", answer) == 0.0
    assert long_tail_reward("1, 2, 3", answer) == 0.6


def test_the_story_reward_is_half_for_its_subject_and_half_for_a_finished_end():
    assert story_reward("Once a Dragon learned to read. The end.", "dragon") == 1.0
    assert story_reward('She smiled. "Goodbye!"', "dragon") == 0.5  # finished, never names it
    assert story_reward("The dragon opened the book and", "dragon") == 0.5  # cut at the cap
    assert story_reward("It was late and", "dragon") == 0.0
    assert long_tail_reward("The cat baked bread.", "cat") == 1.0


def test_each_side_is_a_valid_run_and_only_partial_cuts_rollouts(tmp_path):
    import json

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in long_tail_rows()))
    configs = {side: side_config(side, str(data), str(tmp_path / "runs"), steps=7) for side in SIDES}
    assert [c.async_.max_off_policy_steps for c in configs.values()] == [0, 1, 0, 1]
    assert [c.async_.partial_rollout_tokens for c in configs.values()] == [None, None, 256, 256]
    # a story at the cap ends in 4 segments: its first tokens are 3 steps old on `partial`, 4 on `partial k=1`,
    # which their max_token_age keeps
    assert all(c.sampling.max_completion_tokens == 1024 == 4 * 256 for c in configs.values())
    assert [c.token_age_bound for c in configs.values()] == [0, 1, 3, 4]
    # a whole 1024-token completion on a loaded machine is not failed as a sampler timeout
    assert all(c.inference.request_timeout_s == 900 for c in configs.values())
    assert all(check_partial(c) == [] for c in configs.values())
    # a prompt and a whole story fit one micro-batch: the trainer refuses a longer trace than that
    assert all(c.trainer.micro_batch_tokens >= c.inference.max_model_len == 1152 for c in configs.values())
    assert {c.steps for c in configs.values()} == {8}  # one step past the measured ones, never run


def test_the_sides_rows_summarize_and_render_side_by_side():
    """Five steps of made-up per-step rows through the module's summary, group comparison and RESULTS.md table: the
    3 warm-up steps (slower, shorter batches) count in neither rate."""
    from bench.partial import SIDES, compare_groups, summarize
    from bench.run_all import render_partial, targets

    def rows(step_seconds: float, rewards: tuple[float, ...]) -> list[dict]:
        warm = WORKLOAD["warmup_steps"]
        return [{"step": step, "wall": step_seconds * {1: 3, 2: 2, 3: 2}.get(step, 1), "cpu": 1.0, "load": 2.0,
                 "metrics": {"batch/rl_tokens": 300.0 if step > warm else 100.0, "time/sample_rollouts": 1.0,
                             "time/train": 2.0 if step > warm else 9.0,
                             "partial/rounds": 1.0, "rollouts/dataset/reward_mean": reward},
                 "groups": {f"step{step}-dataset-train-{i}-e0": {"reward": reward, "step": step, "long": i == 1,
                                                                  "completion_tokens": 10.0} for i in (1, 2)}}
                for step, reward in zip(range(1, 6), rewards)]

    sides = {"sync": summarize(rows(6.0, (0.2, 0.4, 0.2, 0.4, 0.3))),
             "partial": summarize(rows(3.0, (0.3, 0.5, 0.3, 0.5, 0.4)))}
    assert sides["sync"]["trained_tokens_per_s"] == 50.0 and sides["partial"]["trained_tokens_per_s"] == 100.0
    assert sides["partial"]["first_step_seconds"] == 9.0 and sides["partial"]["time"]["train"] == 2.0
    assert sides["sync"]["completion_tokens"] == {"long": 10.0, "short": 10.0}
    groups = compare_groups(sides)
    assert len(groups["rows"]) == 10 and groups["means"]["long"] == pytest.approx({"sync": 0.3, "partial": 0.4, "groups": 5})
    result = {"workload": WORKLOAD, "side_configs": {name: SIDES[name] for name in sides}, "steps": 5, "sides": sides,
              "ratios": {"partial / sync": {"trained_tokens_per_s": 2.0, "steps_per_s": 2.0}}, "groups": groups,
              "target": 1.5, "load_before": 1.0, "load_range": [2.0, 2.0], "rounds": [["sync", "partial"]],
              "memory": {"peak_gb": 12.0, "machine_gb": 24.0, "peak_fraction": 0.5, "budget_fraction": 0.75}}
    text = "\n".join(render_partial(result))
    assert ("Sides resident at once, in rounds: sync + partial. Peak memory of the bench's processes together (PSS): "
            "12.0 GB, 50% of the machine's 24.0 GB (budget 75%).") in text
    assert "partial: `max_off_policy_steps = 0`, `partial_rollout_tokens = 256`, `max_token_age = 3`." in text
    assert "| sync | 50.000 |" in text and "| partial | 100.000 |" in text and "| step1 | 0.20* 0.20 | 0.30* 0.30 |" in text
    assert targets({"partial": {"result": result}})[-1][1:] == ["2.00x", ">= 1.5x", True]


def test_the_sides_run_in_rounds_with_sync_when_they_do_not_all_fit():
    from bench.partial import DEFAULT_SIDES, Refused, rounds

    assert rounds(DEFAULT_SIDES, 3) == [DEFAULT_SIDES]
    assert rounds(DEFAULT_SIDES, 2) == [("sync", "partial"), ("sync", "partial k=1")]
    assert rounds(("sync", "k=1", "partial", "partial k=1"), 3) == [("sync", "k=1", "partial"), ("sync", "partial k=1")]
    with pytest.raises(Refused, match="name at most 2, or 'sync' among them"):
        rounds(("partial", "partial k=1", "k=1"), 2)
    with pytest.raises(Refused, match="1 side"):
        rounds(DEFAULT_SIDES, 1)


@pytest.mark.slow
def test_a_side_killed_mid_step_fails_the_benchmark_at_once_naming_it(prefect_api, tmp_path, tiny_model_path):
    """One side of the bench on the tiny model (its real side process, flow run and vLLM engine), SIGKILLed alone as
    the kernel's OOM killer kills, once its first step has started the engine: the benchmark fails within seconds,
    naming the side and how it ended, and nothing of the side is left."""
    import json
    import os
    import signal
    import threading
    import time

    from bench.partial import BenchmarkFailed, run_round
    from trace_rl.machine.processes import children, command, descendants, is_alive, name, start_times

    workload = {**WORKLOAD, "model": tiny_model_path, "max_completion_tokens": 8, "max_model_len": 256,
                "micro_batch_tokens": 256, "request_timeout_s": 60.0, "warmup_steps": 0}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in long_tail_rows(workload)))
    killed: dict = {}

    def kill_mid_step() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            for side in [pid for pid in children(os.getpid()) if "bench.partial --side sync" in command(pid)]:
                tree = [side, *descendants(side)]
                if any(name(pid).startswith("VLLM::EngineCor") for pid in tree):
                    killed["tree"] = start_times(tree)
                    killed["at"] = time.monotonic()
                    os.kill(side, signal.SIGKILL)
                    return
            time.sleep(0.1)

    threading.Thread(target=kill_mid_step, daemon=True).start()
    with pytest.raises(BenchmarkFailed) as failed:
        run_round(("sync",), 2, str(tmp_path / "bench"), str(data), workload)
    assert "at" in killed, f"the side failed before its engine started: {failed.value}"
    assert time.monotonic() - killed["at"] < 5, f"the benchmark took {time.monotonic() - killed['at']:.1f} s to fail"
    assert str(failed.value).startswith("the side 'sync' died: killed by SIGKILL"), failed.value
    deadline = time.monotonic() + 5
    while (left := [name(pid) for pid, start in killed["tree"].items() if is_alive(pid, start)]) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still alive 5 s after the benchmark failed: {left}"
