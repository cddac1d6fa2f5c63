"""Records files: verifiers' own records (trace `to_record()` lines, and the episodes of its `traces.jsonl` as
verifiers' writer writes them) read into replay steps and groups; trace-rl's written and read back; bad files
refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import verifiers.v1 as vf  # the test extra installs it: a missing package fails, never skips
from verifiers.v1.graph import prepare_turn  # noqa: E402
from verifiers.v1.utils.trace_store import write_episode  # noqa: E402

from tests.data.test_trace import make_branch, make_trace  # noqa: E402
from trace_rl.verifiers.records import RecordsError, read_records, write_records  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def rollout(idx: int, reply_ids: list[int], score: float, tokens: bool = True) -> vf.WireTrace:
    """One single-turn episode of task `idx` through verifiers' graph, scored."""
    trace = vf.WireTrace(task={"type": "Arith", "data": {"idx": idx}}, agent={"config": {}}, ok=True)
    turn = prepare_turn(trace, [vf.UserMessage(content=f"task {idx}")])
    sampled = vf.TurnTokens(prompt_ids=[1, 2, 3, 4], completion_ids=reply_ids,
                            completion_logprobs=[-0.123456789] * len(reply_ids), message_spans=[(0, 3)])
    turn.commit(vf.Response(id="r", created=0, model="m", message=vf.AssistantMessage(content="x"),
                            finish_reason="stop", tokens=sampled if tokens else None))
    trace.record_reward("correct", score)
    return trace


def write_lines(path: Path, rows: list) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_trace_records_of_one_task_form_a_group(tmp_path):
    records = [rollout(idx, [10 + k, 11], float(k)).to_record() for idx in (0, 1) for k in range(2)]
    [(step, traces)] = read_records(write_lines(tmp_path / "traces.jsonl", records)).items()
    assert step == 1 and [t.group_id for t in traces] == ["Arith/0", "Arith/0", "Arith/1", "Arith/1"]
    assert [t.reward for t in traces] == [0.0, 1.0, 0.0, 1.0]
    assert traces[1].branches[0].token_ids.tolist() == [1, 2, 3, 4, 11, 11]
    assert traces[1].branches[0].logprobs[-2:].tolist() == [np.float32(-0.1235)] * 2  # to_record keeps 4 decimals
    assert {t.policy_step for t in traces} == {0}  # sampled by the weights step 1 trains from


def test_verifiers_traces_jsonl_episodes_replay_at_their_training_step(tmp_path):
    for step, idx in ((3, 0), (3, 0), (4, 0)):
        episode = vf.Episode(env=vf.EnvInfo(id="math-env"), task=rollout(idx, [9], 1.0).task, ok=True,
                             traces=[rollout(idx, [9], 1.0)],
                             run=vf.TrainRunInfo(id="run", work=vf.TrainWorkInfo(step=step)))
        write_episode(tmp_path, episode)  # verifiers' own writer of traces.jsonl
    by_step = read_records(str(tmp_path / "traces.jsonl"))
    assert sorted(by_step) == [3, 4] and [len(by_step[3]), len(by_step[4])] == [2, 1]
    assert {t.group_id for t in by_step[3]} == {"math-env/0"} and by_step[3][0].env == "math-env"
    assert by_step[4][0].policy_step == 3


@pytest.mark.parametrize("suffix", ["jsonl", "msgpack"])
def test_trace_rl_traces_come_back_in_their_steps_and_groups(tmp_path, suffix):
    continued = make_branch(n=7)
    continued.policy_versions = np.array([-1, -1, -1, 0, 0, 1, 1], np.int32)  # cut after two tokens, continued
    steps = {2: [make_trace("a", group="g2", reward=1.0, policy_step=1, branches=[continued]),
                 make_trace("b", group="g2", reward=0.0, error="boom", branches=[])],
             3: [make_trace("c", group="g3", branches=[make_branch(), make_branch(index=1, n=7, trainable=False)])]}
    path = str(tmp_path / f"traces.{suffix}")
    assert write_records(path, steps, model="tiny") == 3
    back = read_records(path)
    assert sorted(back) == [2, 3]
    for step, traces in steps.items():
        assert all(a.equals(b) for a, b in zip(back[step], traces)), [t.to_dict() for t in back[step]]
    assert back[2][0].branches[0].policy_versions.tolist() == [-1, -1, -1, 0, 0, 1, 1]
    record = read_first_record(path)
    assert record["info"]["trace_rl"]["policy"] == vf.PolicySpan(start=0, end=1).model_dump()


def read_first_record(path: str) -> dict:
    if path.endswith(".msgpack"):
        import msgpack

        return next(iter(msgpack.Unpacker(open(path, "rb"), raw=False, strict_map_key=False)))
    return json.loads(Path(path).read_text().splitlines()[0])


def test_records_without_token_ids_are_refused_naming_the_first(tmp_path):
    records = [rollout(0, [5], 1.0).to_record(), rollout(1, [5], 1.0, tokens=False), rollout(2, [5], 1.0, False)]
    path = write_lines(tmp_path / "eval.jsonl", [records[0], records[1].to_record(), records[2].to_record()])
    with pytest.raises(RecordsError) as refused:
        read_records(path)
    message = str(refused.value)
    assert message.startswith(f"{path} line 2: trace {records[1].id} has sampled turns without token ids (sampled "
                              "through an eval client")
    assert "\n" not in message and records[2].id not in message


@pytest.mark.parametrize("line, what", [
    ("not json", "line 2: not JSON"),
    ('{"id": "x", "reward": 1}', "line 2: not a verifiers v1 trace record; expected one JSON object a line"),
    ('{"task": {"type": "T", "data": {}}, "nodes": [{"token_ids": "abc"}]}',
     "line 2: not a verifiers v1 trace record: agent: Field required"),
])
def test_a_file_that_is_not_verifiers_records_is_refused_in_one_line(tmp_path, line, what):
    path = write_lines(tmp_path / "bad.jsonl", [rollout(0, [5], 1.0).to_record(), line])
    with pytest.raises(RecordsError, match=f"^{path} {what}") as refused:
        read_records(path)
    assert "\n" not in str(refused.value)


def test_a_trace_id_twice_in_one_step_is_refused(tmp_path):
    record = rollout(0, [5], 1.0).to_record()
    path = write_lines(tmp_path / "twice.jsonl", [record, record])
    with pytest.raises(RecordsError, match=f"line 2: trace id '{record['id']}' appears twice in step 1"):
        read_records(path)


def test_without_verifiers_the_check_names_the_extra(tmp_path):
    """In an interpreter whose packages are this environment's but verifiers' (each entry of site-packages linked
    into a directory of its own, verifiers and its metadata left out)."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    packages = tmp_path / "site-packages"
    packages.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith("verifiers"):
            (packages / entry.name).symlink_to(entry)
    code = ("import sys; sys.path[:0] = sys.argv[1:]; from trace_rl.verifiers.extra import require_verifiers\n"
            "try: require_verifiers('--traces x.jsonl')\nexcept Exception as exc: print(type(exc).__name__, exc)")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(ROOT), str(packages)], capture_output=True,
                         text=True, check=True).stdout
    assert out == ("VerifiersMissingError --traces x.jsonl needs the verifiers package, which is not installed; "
                   "pip install 'trace-rl[verifiers]'\n")
