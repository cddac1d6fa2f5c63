import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.data.test_trace import make_branch, make_trace
from trace_rl.data.sample import TrainingSample
from trace_rl.errors import StorageFullError
from trace_rl.storage import RunStorage
from trace_rl.tables import read_batch, read_traces, write_batch, write_traces


def sample_traces():
    b = make_branch()
    b.advantages, b.mask = np.linspace(-1, 1, 5).astype(np.float32), np.array([0, 0, 0, 1, 1], bool)
    b.policy_versions = np.array([-1, -1, -1, 2, 3], np.int32)  # cut after token 3, continued under step 3's weights
    return [
        make_trace("t0", reward=1.0, rewards={"sim": 1.0}, info={"answer": "x", "n": [1, 2]},
                   branches=[b, make_branch(index=1, n=7, trainable=False)]),
        make_trace("t1", reward=0.0, error="sampler timeout", branches=[]),
        make_trace("t2", agent="judge", trainable=False, policy_step=3),
    ]


def sample_batch():
    return [
        TrainingSample(
            trace_id=f"t{i}", branch_index=0, env="reverse-text", input_ids=np.arange(n), temperature=0.7,
            sampled=np.arange(n) > 1, inference_logprobs=np.full(n, -0.25), rl_values=np.linspace(0, 1, n),
            rl_mask=np.arange(n) > 1, ce_values=np.zeros(n), ce_mask=np.zeros(n, bool),
            policy_versions=np.where(np.arange(n) > 1, np.arange(n) // 3, -1),
        )
        for i, n in enumerate([4, 9])
    ]


@pytest.fixture(params=["local", "memory", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return RunStorage(str(tmp_path), "run")
    if request.param == "memory":
        return RunStorage(f"memory://trace-rl-{tmp_path.name}", "run")
    s3 = request.getfixturevalue("s3_server")
    return RunStorage(f"s3://{s3['bucket']}/{tmp_path.name}", "run", s3["storage_options"])


def test_traces_round_trip_exactly(storage):
    traces = sample_traces()
    write_traces(storage, 3, traces)
    back = read_traces(storage, 3)
    assert [t.id for t in back] == ["t0", "t1", "t2"]
    assert all(a.equals(b) for a, b in zip(traces, back))
    assert back[1].branches == [] and back[1].error == "sampler timeout"


def test_batches_round_trip_exactly(storage):
    batch = sample_batch()
    write_batch(storage, 0, batch)
    back = read_batch(storage, 0)
    for a, b in zip(batch, back):
        assert (a.trace_id, a.branch_index, a.env) == (b.trace_id, b.branch_index, b.env)
        for name in ("input_ids", "sampled", "inference_logprobs", "rl_values", "rl_mask", "ce_values", "ce_mask",
                     "policy_versions"):
            expected = getattr(a, name)
            got = getattr(b, name)
            bools = {"sampled": np.bool_, "rl_mask": np.bool_, "ce_mask": np.bool_}
            assert got.dtype == {"input_ids": np.int32, "policy_versions": np.int32, **bools}.get(name, np.float32)
            np.testing.assert_array_equal(got, expected.astype(got.dtype))


def test_a_batch_of_samples_without_versions_has_no_column_and_reads_back_none(tmp_path):
    from trace_rl.tables import samples_to_table

    storage = RunStorage(str(tmp_path), "run")
    unversioned = sample_batch()
    for sample in unversioned:
        sample.policy_versions = None
    assert "policy_versions" not in samples_to_table(unversioned).column_names
    write_batch(storage, 2, unversioned)
    assert [s.policy_versions for s in read_batch(storage, 2)] == [None, None]
    with pytest.raises(ValueError, match="policy_versions: every sample of a batch carries them, or none does"):
        samples_to_table([*sample_batch(), *unversioned])


def test_layout_uses_six_digit_steps(storage):
    write_traces(storage, 12, sample_traces())
    assert storage.exists(storage.path("steps", "000012", "traces.parquet"))


def test_interrupted_file_write_leaves_nothing_readable(storage):
    path = storage.step_path(1, "batch.parquet")

    def crash_midway(f):
        f.write(b"PAR1 half a parquet file")
        raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        storage.write_atomic(path, crash_midway)
    assert not storage.exists(path)
    assert storage.fs.find(storage.path("steps")) == []  # no temporary left behind either


def test_directories_count_only_once_marked_stable(storage):
    for step in (1, 2, 3):
        directory = storage.path("checkpoints", f"{step:06d}")
        storage.fs.makedirs(directory, exist_ok=True)
        storage.write_atomic(f"{directory}/model.bin", b"weights")
        if step != 3:
            storage.mark_stable(directory)
    assert storage.stable_steps("checkpoints") == [1, 2]
    assert storage.latest_stable("checkpoints") == 2


def test_upload_and_download_dir(storage, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.json").write_text("{}")
    (src / "sub" / "b.bin").write_bytes(b"\x00\x01")
    target = storage.path("weights", "000004")
    storage.upload_dir(str(src), target)
    assert storage.latest_stable("weights") == 4
    storage.download_dir(target, str(tmp_path / "dst"))
    assert (tmp_path / "dst" / "sub" / "b.bin").read_bytes() == b"\x00\x01"
    assert not (tmp_path / "dst" / "STABLE").exists()


def test_a_staged_directory_is_stable_once_written_and_gone_when_its_writer_fails(storage, tmp_path):
    """Locally the files are written in place (once); elsewhere staged and uploaded. Either way STABLE comes
    last, a rewrite replaces the old files, and a writer that raises leaves no directory a reader takes."""
    target = storage.path("weights", "000002")
    storage.fs.makedirs(target, exist_ok=True)
    storage.write_atomic(f"{target}/stale.bin", b"old")
    with storage.staged_dir(target) as staging:
        local = storage.protocol in ("file", "local")
        assert (staging == target) == local
        assert not storage.is_stable(target)
        os.makedirs(os.path.join(staging, "sub"))
        with open(os.path.join(staging, "sub", "b.bin"), "wb") as f:
            f.write(b"\x00\x01")
    assert storage.latest_stable("weights") == 2
    assert storage.read_bytes(f"{target}/sub/b.bin") == b"\x00\x01"
    assert not storage.exists(f"{target}/stale.bin")
    failed = storage.path("weights", "000003")
    with pytest.raises(OSError, match="disk on fire"), storage.staged_dir(failed) as staging:
        open(os.path.join(staging, "model.safetensors"), "wb").close()
        raise OSError("disk on fire")
    assert storage.stable_steps("weights") == [2]
    assert not storage.exists(failed) or not storage.fs.find(failed)
    if not local:
        return  # elsewhere the files are staged on this machine's disk, and only the upload writes to the storage
    # no room, as safetensors (from Rust) and torch (behind its own error) report it: a StorageFullError that says so
    for error in (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
                  RuntimeError("unexpected pos 704 vs 598")):
        if "os error" not in str(error):
            error.__context__ = OSError(28, "No space left on device")
        with pytest.raises(StorageFullError, match="no room to write .*000003: No space left on device"), \
                storage.staged_dir(failed):
            raise error
        assert storage.stable_steps("weights") == [2]


def test_killed_writer_process_leaves_no_complete_file(tmp_path):
    """SIGKILL in the middle of a write: the final path never appears."""
    script = (
        "import sys, time; from trace_rl.storage import RunStorage\n"
        f"s = RunStorage({str(tmp_path)!r}, 'run')\n"
        "def slow(f):\n"
        "    f.write(b'x' * 1000); f.flush(); print('writing', flush=True); time.sleep(60)\n"
        "s.write_atomic(s.step_path(0, 'traces.parquet'), slow)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    storage = RunStorage(str(tmp_path), "run")
    assert not storage.exists(storage.step_path(0, "traces.parquet"))


def test_tables_are_readable_by_common_tools(tmp_path):
    import duckdb
    import pandas as pd
    import polars as pl

    storage = RunStorage(str(tmp_path), "run")
    path = write_traces(storage, 0, sample_traces())
    assert len(pd.read_parquet(path)) == 4  # one row per branch; the errored trace keeps one row
    assert pl.read_parquet(path)["trace_id"].to_list() == ["t0", "t0", "t1", "t2"]
    assert duckdb.sql(f"select count(*) from '{path}' where branch_index is null").fetchall()[0][0] == 1
    batch = write_batch(storage, 0, sample_batch())
    assert pq.read_table(batch).column("input_ids").type.value_type.bit_width == 32
    assert pd.read_parquet(batch)["rl_mask"].map(len).tolist() == [4, 9]


def test_a_missing_or_mistyped_column_names_the_file_and_the_column(tmp_path):
    import pyarrow as pa

    from trace_rl.data.channel import Channel
    from trace_rl.tables import TableError, channels_to_table, read_channels, samples_to_table, traces_to_table

    storage = RunStorage(str(tmp_path), "run")
    write_traces(storage, 1, sample_traces())
    traces_path = storage.step_path(1, "traces.parquet")
    pq.write_table(traces_to_table(sample_traces()).drop_columns(["group_id"]), traces_path)
    with pytest.raises(TableError, match=f"{traces_path}: column 'group_id' \\(string\\) is missing"):
        read_traces(storage, 1)
    table = traces_to_table(sample_traces())
    as_text = table.set_column(table.column_names.index("reward"), "reward", table.column("reward").cast(pa.string()))
    pq.write_table(as_text, traces_path)
    with pytest.raises(TableError, match=f"{traces_path}: column 'reward' has type string, expected double"):
        read_traces(storage, 1)

    write_batch(storage, 1, sample_batch())
    batch_path = storage.step_path(1, "batch.parquet")
    pq.write_table(samples_to_table(sample_batch()).drop_columns(["rl_mask"]), batch_path)
    with pytest.raises(TableError, match=f"{batch_path}: column 'rl_mask' \\(list<bool>\\) is missing"):
        read_batch(storage, 1)
    table = samples_to_table(sample_batch())
    ints = table.set_column(table.column_names.index("rl_values"), "rl_values",
                            pa.array([[0] * 4, [1] * 9], pa.list_(pa.int64())))
    pq.write_table(ints, batch_path)
    with pytest.raises(TableError, match=f"{batch_path}: column 'rl_values' has type list<int64>, "
                                         "expected list<float>"):
        read_batch(storage, 1)

    channels_path = storage.path("steps", "000001", "channels", "00-grpo.parquet")
    channel = Channel("grpo", "rl", "t0", 0, np.zeros(5, np.float32), np.zeros(5, bool))
    storage.fs.makedirs(storage.path("steps", "000001", "channels"), exist_ok=True)
    pq.write_table(channels_to_table([channel]).drop_columns(["loss"]), channels_path)
    with pytest.raises(TableError, match=f"{channels_path}: column 'loss' \\(string\\) is missing"):
        read_channels(storage, channels_path)


def test_large_string_and_list_columns_read_like_the_plain_ones(tmp_path):
    """What pandas or polars may write (large_string, large_list) reads as the schema's types."""
    import pyarrow as pa

    from trace_rl.tables import traces_to_table

    storage = RunStorage(str(tmp_path), "run")
    table = traces_to_table(sample_traces())
    large = pa.schema([f.with_type(pa.large_string()) if f.type == pa.string() else
                       f.with_type(pa.large_list(f.type.value_type)) if f.name in ("token_ids", "sampled") else f
                       for f in table.schema])
    storage.fs.makedirs(storage.path("steps", "000002"), exist_ok=True)
    pq.write_table(table.cast(large), storage.step_path(2, "traces.parquet"))
    back = read_traces(storage, 2)
    assert all(a.equals(b) for a, b in zip(sample_traces(), back, strict=True))
