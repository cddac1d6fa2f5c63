"""`--overwrite` deletes one run and nothing else: replay's --out never overlaps the source run, and a run
directory that holds other runs, lies inside one, or is no run at all is never wiped. Real directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.data.test_trace import make_trace
from trace_rl.algorithms.base import AlgorithmConfig
from trace_rl.config import ConfigError
from trace_rl.errors import RefusedError
from trace_rl.offline.replay import check_replay
from trace_rl.runs.loading import validate_config
from trace_rl.runs.start import prepare_run
from trace_rl.storage import RunStorage, overlap
from trace_rl.tables import write_traces

GRPO = [AlgorithmConfig(id="grpo")]


def run_config(storage: str, name: str):
    return validate_config({"name": name, "storage": storage, "env": [{"id": "reverse-text"}]})


def make_run(storage: str, name: str) -> RunStorage:
    """A real run directory: its config.toml and the traces of step 1."""
    run, _ = prepare_run(run_config(storage, name), "new")
    write_traces(run, 1, [make_trace("t0")])
    return run


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def source(tmp_path) -> RunStorage:
    return make_run(str(tmp_path / "runs"), "src")


@pytest.mark.parametrize("out, relation", [
    ("{runs}/src", "is the source run {runs}/src itself"),
    ("{runs}//src/", "is the source run {runs}/src itself"),
    ("{runs}/other/../src", "is the source run {runs}/src itself"),
    ("{runs}/src/replayed", "is inside the source run {runs}/src"),
    ("{runs}/src/steps", "is inside the source run {runs}/src"),
    ("{runs}", "contains the source run {runs}/src"),
    ("{tmp}", "contains the source run {runs}/src"),
])
def test_replay_refuses_an_out_overlapping_the_source_before_deleting_anything(source, tmp_path, out, relation):
    runs = tmp_path / "runs"
    before = files(tmp_path)
    out = out.format(runs=runs, tmp=tmp_path)
    expected = relation.format(runs=runs)
    for overwrite in (False, True):
        with pytest.raises(RefusedError, match=f"{expected}; replay never writes over the original run"):
            check_replay(source.url, GRPO, out, overwrite=overwrite)
    assert files(tmp_path) == before


def test_replay_sees_through_a_symlink_to_the_source(source, tmp_path):
    os.symlink(tmp_path / "runs", tmp_path / "alias")
    with pytest.raises(RefusedError, match="is the source run"):
        check_replay(source.url, GRPO, str(tmp_path / "alias" / "src"), overwrite=True)
    assert (tmp_path / "runs" / "src" / "config.toml").exists()


def test_replay_overwrite_refuses_an_out_holding_other_runs_or_no_run_at_all(source, tmp_path):
    make_run(str(tmp_path / "elsewhere"), "a")
    make_run(str(tmp_path / "elsewhere"), "b/c")
    before = files(tmp_path)
    with pytest.raises(RefusedError, match=f"--overwrite would delete {tmp_path}/elsewhere, which holds other runs "
                                           f"\\({tmp_path}/elsewhere/a, {tmp_path}/elsewhere/b/c\\); nothing was "
                                           "deleted"):
        check_replay(source.url, GRPO, str(tmp_path / "elsewhere"), overwrite=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(RefusedError, match="which is not a trace-rl run directory"):
        check_replay(source.url, GRPO, str(tmp_path / "notes"), overwrite=True)
    with pytest.raises(RefusedError, match=f"which is inside the run {tmp_path}/elsewhere/a"):
        check_replay(source.url, GRPO, str(tmp_path / "elsewhere" / "a" / "steps"), overwrite=True)
    assert files(tmp_path) == sorted(before + ["notes", "notes/todo.txt"])


def test_replay_overwrite_wipes_an_earlier_replay_out(source, tmp_path):
    out = tmp_path / "replayed"
    (out / "steps" / "000001").mkdir(parents=True)
    (out / "replay.json").write_text("{}")
    plan = check_replay(source.url, GRPO, str(out), overwrite=True)
    assert plan.out.url == str(out) and plan.steps == [1]


def test_replay_compares_memory_urls_normalized():
    source = make_run("memory://guard-test/runs", "src")
    for out in ("memory://guard-test/runs", "memory://guard-test/runs/./src", "memory://guard-test/runs/src/x"):
        with pytest.raises(RefusedError, match="never writes over the original run"):
            check_replay(source.url, GRPO, out, overwrite=True)
    assert source.exists(source.path("config.toml"))


def test_overlap_of_s3_urls_is_a_comparison_of_normalized_paths():
    def s3(url: str) -> RunStorage:
        return RunStorage.from_url(url, {"anon": True})

    assert overlap(s3("s3://bucket/runs//src/"), s3("s3://bucket/runs/src")) == "is"
    assert overlap(s3("s3://bucket/runs/src/out"), s3("s3://bucket/runs/src")) == "is inside"
    assert overlap(s3("s3://bucket/runs"), s3("s3://bucket/runs/src")) == "contains"
    assert overlap(s3("s3://bucket/runs/src2"), s3("s3://bucket/runs/src")) is None
    assert overlap(s3("s3://other/runs/src"), s3("s3://bucket/runs/src")) is None
    assert overlap(RunStorage.from_url("memory://bucket/runs/src"), s3("s3://bucket/runs/src")) is None


def test_train_overwrite_refuses_a_directory_holding_other_runs(tmp_path):
    make_run(str(tmp_path / "runs"), "a")
    make_run(str(tmp_path / "runs"), "sweep/lr-1")
    before = files(tmp_path)
    for storage, name, held in ((tmp_path, "runs", "runs/a, .*/runs/sweep/lr-1"), (tmp_path / "runs", "sweep",
                                                                                  "runs/sweep/lr-1")):
        with pytest.raises(RefusedError, match=f"--overwrite would delete {storage}/{name}, which holds other runs "
                                               f"\\({tmp_path}/{held}\\); nothing was deleted; check `storage` and "
                                               "`name`"):
            prepare_run(run_config(str(storage), name), "overwrite")
    assert files(tmp_path) == before


def test_train_overwrite_refuses_a_directory_inside_another_run_or_no_run(tmp_path):
    run = make_run(str(tmp_path / "runs"), "a")
    before = files(tmp_path)
    with pytest.raises(RefusedError, match=f"which is inside the run {run.url}"):
        prepare_run(run_config(run.url, "steps"), "overwrite")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "main.py").write_text("print('mine')")
    with pytest.raises(RefusedError, match=f"would delete {tmp_path}/code, which is not a trace-rl run directory"):
        prepare_run(run_config(str(tmp_path), "code"), "overwrite")
    assert files(tmp_path) == sorted(before + ["code", "code/main.py"])


def test_train_overwrite_still_wipes_the_run_itself(tmp_path):
    run = make_run(str(tmp_path / "runs"), "a")
    (tmp_path / "runs" / "a" / "stale.txt").write_text("old")
    storage, first = prepare_run(run_config(str(tmp_path / "runs"), "a"), "overwrite")
    assert first == 1 and files(tmp_path / "runs" / "a") == ["config.toml", "trace-rl.json"]
    assert storage.url == run.url


@pytest.mark.parametrize("name", [".", "..", "a/..", "../elsewhere", "/abs", "a//b", "a/"])
def test_a_name_must_be_a_directory_below_storage(name):
    with pytest.raises(ConfigError, match=f"name: {name!r} must name a directory below `storage`"):
        run_config("runs", name)


def write_toml(tmp_path: Path, **data) -> str:
    import tomli_w

    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps({"name": "demo2", "steps": 2, "env": [{"id": "reverse-text"}],
                                   "inference": {"backend": "hf"}, **data}))
    return str(path)


def finished_run(storage: str, steps: int, **data) -> RunStorage:
    """A run directory as training leaves it after `steps` steps: config.toml, the last checkpoint and weights."""
    run, _ = prepare_run(validate_config({"name": "demo2", "steps": steps, "storage": storage,
                                          "env": [{"id": "reverse-text"}], "inference": {"backend": "hf"}, **data}),
                         "new")
    for kind in ("checkpoints", "weights"):
        run.mark_stable(run.path(kind, f"{steps:06d}"))
    return run


def test_resuming_a_finished_run_says_so_and_starts_nothing(tmp_path, capsys, monkeypatch):
    from flows import cli
    from trace_rl.runs.start import finished_message

    monkeypatch.setattr(cli, "_prefect", lambda *a: pytest.fail("a finished run started Prefect"))
    run = finished_run(str(tmp_path / "runs"), 2)
    config = write_toml(tmp_path, storage=str(tmp_path / "runs"))
    assert cli.main(["train", config, "--resume"]) == 0
    assert capsys.readouterr().err == (f"demo2 is already finished: all 2 steps are trained ({run.url}); nothing to "
                                       "do. To train on, raise steps: --resume --set steps=N with N > 2\n")
    assert cli.main(["train", config, "--resume", "--set", "steps=1"]) == 0
    assert "demo2 is already finished: it is trained to step 2, past steps = 1" in capsys.readouterr().err
    # steps raised: there is something to do
    assert finished_message(validate_config({"name": "demo2", "steps": 3, "storage": str(tmp_path / "runs"),
                                             "env": [{"id": "reverse-text"}]}), run) is None


def test_a_finished_run_whose_last_eval_is_missing_is_not_finished(tmp_path):
    from trace_rl.runs.start import finished_message
    from trace_rl.storage import eval_dir

    evaluation = {"envs": [{"id": "reverse-text"}]}
    run = finished_run(str(tmp_path / "runs"), 2, eval=evaluation)
    config = validate_config({"name": "demo2", "steps": 2, "storage": str(tmp_path / "runs"),
                              "env": [{"id": "reverse-text"}], "eval": evaluation})
    assert finished_message(config, run) is None  # the resume runs the eval the last process did not finish
    run.mark_stable(eval_dir(run, 2))
    assert finished_message(config, run).startswith("demo2 is already finished")


@pytest.mark.parametrize("storage", ["/dev/null/x", "{tmp}/file/runs"])
def test_a_storage_where_no_directory_can_be_made_is_one_error_naming_storage(tmp_path, capsys, monkeypatch, storage):
    from flows import cli
    from trace_rl.runs.start import check_run

    monkeypatch.setattr(cli, "_prefect", lambda *a: pytest.fail("started Prefect"))
    (tmp_path / "file").write_text("a file, not a directory")
    storage = storage.format(tmp=tmp_path)
    assert cli.main(["train", write_toml(tmp_path, storage=storage)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: storage = '{storage}': cannot ") and "Not a directory" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    # the check every start makes (`prepare_run` too, for a run started from the UI)
    config = validate_config({"name": "demo2", "storage": storage, "env": [{"id": "reverse-text"}]})
    with pytest.raises(RefusedError) as info:
        check_run(config, "new")
    assert str(info.value).startswith(f"storage = '{storage}': cannot write to the run directory {storage}/demo2 "
                                      "(NotADirectoryError: ")
    assert str(info.value).endswith("); set storage to a directory you can write to, e.g. --set storage=runs")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
def test_a_storage_without_write_permission_is_one_error_naming_storage(tmp_path):
    from trace_rl.runs.start import check_run

    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(RefusedError, match=r"storage = '.*/ro': cannot (create|write to) the run directory"):
        check_run(run_config(str(tmp_path / "ro"), "demo2"), "new")


@pytest.mark.parametrize("recorded, version", [(None, "0.1"), (b'{"version": "0.1.7"}', "0.1.7")])
def test_a_run_of_an_older_release_is_refused_by_resume_and_replay_in_one_line(tmp_path, capsys, monkeypatch,
                                                                               recorded, version):
    from flows import cli
    from trace_rl.version import VERSION, VERSION_FILE

    monkeypatch.setattr(cli, "_prefect", lambda *a: pytest.fail("an older run started Prefect"))
    run = finished_run(str(tmp_path / "runs"), 1)
    assert run.read_json(run.path(VERSION_FILE)) == {"version": VERSION}
    run.remove(run.path(VERSION_FILE))
    if recorded is not None:
        run.write_atomic(run.path(VERSION_FILE), recorded)
    config = write_toml(tmp_path, storage=str(tmp_path / "runs"), steps=3)
    refusal = (f"the run was written by trace-rl {version}, this is trace-rl {VERSION}, which reads runs of its own "
               f"release only (CHANGELOG.md); start it anew (--overwrite) or use trace-rl {version}\n")
    assert cli.main(["train", config, "--resume"]) == 2
    assert capsys.readouterr().err == f"error: --resume {run.url}: {refusal}"
    assert cli.main(["replay", "--run", run.url, "--algorithms", '["grpo"]', "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: --run {run.url}: {refusal}"
