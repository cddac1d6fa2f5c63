"""The `dataset` env: rows from JSONL, Parquet, CSV and `datasets` directories, its rewards, and bad data."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.envs.conftest import ScriptedRuntime
from tests.flows.conftest import small_config
from trace_rl.config import ConfigError, SamplingConfig
from trace_rl.envs import EnvError, Sampler, load_env
from trace_rl.envs.rewards import exact_match, load_reward, math_match, numeric_match
from trace_rl.models.tiny import build_tokenizer
from trace_rl.runs.loading import validate_config

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 7)]
SAMPLING = SamplingConfig(temperature=1.0, max_completion_tokens=8)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def prompts(env, examples) -> list[str]:
    return [env.rows[e.data["row"]][0][-1].content for e in examples]


def rollout(env, example, reply: str):
    runtime = ScriptedRuntime(build_tokenizer(), [reply])
    return asyncio.run(env.rollout(example, Sampler(runtime, SAMPLING, seed=0)))[0]


def test_jsonl_rows_prompt_answer_and_system_prompt(tmp_path):
    env = load_env("dataset", {"path": write_jsonl(tmp_path / "d.jsonl", ROWS), "shuffle": False,
                               "system_prompt": "Be brief.", "reward": "numeric"})
    [example] = env.examples_for_step(0, 2, 0, 1)
    assert example.data["row"] == 1 and example.id == "train-2-e0"
    trace = rollout(env, example, "It is 4")
    assert [m.role for m in trace.messages] == ["system", "user", "assistant"]
    assert trace.messages[0].content == "Be brief." and trace.messages[1].content == "What is 2 + 2?"
    assert trace.reward == 1.0 and trace.info["answer"] == "4" and trace.rewards == {"numeric": 1.0}
    assert rollout(env, example, "It is 5").reward == 0.0


def test_parquet_csv_and_a_fsspec_url_give_the_same_rows(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("prompt,answer\n" + "".join(f"\"{r['prompt']}\",{r['answer']}\n" for r in ROWS))
    envs = [load_env("dataset", {"path": path, "shuffle": False}) for path in
            (str(tmp_path / "d.parquet"), str(tmp_path / "d.csv"), f"file://{tmp_path}/d.csv",
             write_jsonl(tmp_path / "d.jsonl", ROWS))]
    assert all(env.rows == envs[0].rows for env in envs) and len(envs[0].rows) == 6


def test_a_datasets_directory_with_splits_and_column_mapping(tmp_path):
    import datasets

    renamed = [{"question": r["prompt"], "solution": r["answer"]} for r in ROWS]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(renamed[:4]),
                          "eval": datasets.Dataset.from_list(renamed[4:])}).save_to_disk(str(tmp_path / "ds"))
    args = {"path": str(tmp_path / "ds"), "prompt_column": "question", "answer_column": "solution", "shuffle": False}
    train, held_out = load_env("dataset", args), load_env("dataset", {**args, "split": "eval"})
    assert [a for _, a in train.rows] == ["2", "4", "6", "8"] and [a for _, a in held_out.rows] == ["10", "12"]
    with pytest.raises(EnvError, match="has no split 'test'"):
        load_env("dataset", {**args, "split": "test"})


def test_chat_rows_from_a_messages_column(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Answer with a number."},
                          {"role": "user", "content": "2 + 3?"}], "answer": "5"}]
    env = load_env("dataset", {"path": write_jsonl(tmp_path / "chat.jsonl", rows), "messages_column": "messages",
                               "system_prompt": "ignored: the row has its own"})
    trace = rollout(env, env.examples_for_step(0, 1, 0, 1)[0], "5")
    assert [(m.role, m.content) for m in trace.messages] == [
        ("system", "Answer with a number."), ("user", "2 + 3?"), ("assistant", "5")]
    assert trace.reward == 1.0


def test_splits_by_file_seeded_shuffle_and_epochs(tmp_path):
    paths = {"train": write_jsonl(tmp_path / "train.jsonl", ROWS), "eval": write_jsonl(tmp_path / "e.jsonl", ROWS[:2])}
    env = load_env("dataset", {"path": paths})
    first_epoch = [e.data["row"] for step in (1, 2, 3) for e in env.examples_for_step(7, step, 0, 2)]
    assert sorted(first_epoch) == list(range(6)) and first_epoch != list(range(6))  # each row once, shuffled
    assert first_epoch == [e.data["row"] for step in (1, 2, 3) for e in env.examples_for_step(7, step, 0, 2)]
    other_seed = [e.data["row"] for step in (1, 2, 3) for e in env.examples_for_step(8, step, 0, 2)]
    assert sorted(other_seed) == list(range(6)) and other_seed != first_epoch
    second_epoch = [e.data["row"] for e in env.examples_for_step(7, 4, 0, 6)]  # rows 6..11: all of epoch 1
    assert sorted(second_epoch) == list(range(6)) and second_epoch != first_epoch
    ids = [e.id for e in env.examples_for_step(7, 2, 0, 4)]  # straddles the epochs: ids stay distinct
    assert len(set(ids)) == 4 and {i.rsplit("-", 1)[1] for i in ids} == {"e0", "e1"}
    once = load_env("dataset", {"path": paths, "epochs": 1})
    once.examples_for_step(7, 3, 0, 2)
    with pytest.raises(EnvError, match="1 epoch\\(s\\) of 6 rows are used up at step 4"):
        once.examples_for_step(7, 4, 0, 2)
    assert [a for _, a in load_env("dataset", {"path": paths, "split": "eval"}).rows] == ["2", "4"]


@pytest.mark.parametrize("answer,completion", [
    ("\\frac{1}{2}", "so the answer is \\boxed{0.5}"), ("1/2", "The answer is $\\frac{1}{2}$"),
    ("\\frac{3}{4}", "\\boxed{\\frac{6}{8}}"), ("\\sqrt{2}", "\\boxed{2^{1/2}}"), ("26", "Ivo has \\boxed{26} now"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
])
def test_math_verify_accepts_equivalent_answers(answer, completion):
    assert math_match(completion, answer) == 1.0


@pytest.mark.parametrize("answer,completion", [
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"), ("26", "\\boxed{25}"), ("\\sqrt{2}", "\\boxed{2}"), ("3", "no idea"),
])
def test_math_verify_rejects_other_answers(answer, completion):
    assert math_match(completion, answer) == 0.0


def test_exact_numeric_and_imported_rewards():
    assert exact_match("  the  answer\n", "the answer") == 1.0 and exact_match("The answer", "the answer") == 0.0
    assert numeric_match("so 1,234 apples", "1234") == 1.0 and numeric_match("3/4 of it", "0.75") == 1.0
    assert numeric_match("first 3, then 5", "3") == 0.0 and numeric_match("none", "3") == 0.0
    assert load_reward("trace_rl.envs.rewards:exact_match") is exact_match
    with pytest.raises(EnvError, match="reward 'no_such_module:f': module 'no_such_module' was not found on sys.path"):
        load_reward("no_such_module:f")
    with pytest.raises(EnvError, match="reward 'trace_rl.envs.rewards:nothing': module 'trace_rl.envs.rewards' has no attribute 'nothing'; "
                                        "check the name after ':'"):
        load_reward("trace_rl.envs.rewards:nothing")
    with pytest.raises(EnvError, match="unknown reward 'fuzzy'"):
        load_reward("fuzzy")


def test_math_reward_in_a_rollout_runs_off_the_main_thread(tmp_path):
    """Rollouts run on worker threads, where math-verify's SIGALRM timeouts would fail."""
    from concurrent.futures import ThreadPoolExecutor

    env = load_env("dataset", {"path": write_jsonl(tmp_path / "m.jsonl", [{"prompt": "half?", "answer": "1/2"}]),
                               "reward": "math"})
    example = env.examples_for_step(0, 1, 0, 1)[0]
    with ThreadPoolExecutor(1) as pool:
        trace = pool.submit(rollout, env, example, "It is \\boxed{\\frac{2}{4}}").result()
    assert trace.reward == 1.0 and trace.rewards == {"math": 1.0}


def config_problems(tmp_path, args: dict) -> str:
    data = small_config(str(tmp_path / "runs"), "bad-data")
    data["env"] = [{"id": "dataset", "args": args}]
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    return str(caught.value)


def test_bad_data_is_an_error_at_config_load_naming_file_row_and_column(tmp_path):
    rows = ROWS[:2] + [{"prompt": "3 + 3?"}]
    path = write_jsonl(tmp_path / "missing.jsonl", rows)
    assert f"env.0: {path}: row 3: no column 'answer' (columns: prompt)" in config_problems(tmp_path, {"path": path})
    path = write_jsonl(tmp_path / "empty.jsonl", [ROWS[0], {"prompt": "  ", "answer": "1"}])
    assert f"{path}: row 2: column 'prompt' is an empty prompt" in config_problems(tmp_path, {"path": path})
    path = write_jsonl(tmp_path / "mapped.jsonl", ROWS)
    assert f"{path}: row 1: no column 'question'" in config_problems(tmp_path, {"path": path,
                                                                               "prompt_column": "question"})
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    assert f"{broken}: line 2 is not valid JSON" in config_problems(tmp_path, {"path": str(broken)})
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    assert f"{garbage}: not a readable Parquet file" in config_problems(tmp_path, {"path": str(garbage)})
    assert f"{tmp_path}/nope.csv: no such file" in config_problems(tmp_path, {"path": f"{tmp_path}/nope.csv"})
    assert "unknown file type" in config_problems(tmp_path, {"path": write_jsonl(tmp_path / "d.txt", ROWS)})
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user"}], "answer": "1"}])
    assert f"{chat}: row 1: column 'messages': every message needs a role and a content" in config_problems(
        tmp_path, {"path": chat, "messages_column": "messages"})


def test_eval_envs_are_checked_too(tmp_path):
    data = small_config(str(tmp_path / "runs"), "bad-eval")
    data["eval"] = {"envs": [{"id": "dataset", "args": {"path": str(tmp_path / "none.jsonl"), "split": "eval"}}]}
    with pytest.raises(ConfigError, match="eval.envs.0: .*none.jsonl: no such file"):
        validate_config(data)
