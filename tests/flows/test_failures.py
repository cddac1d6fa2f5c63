"""A run that cannot go on ends in one `error:` line with the cause and the fix, never a traceback: what can be
checked before step 1 is refused there (exit 2, no flow run), a step that fails ends the command (exit 1) and
the run resumes once the cause is fixed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import tomli_w

from tests.flows.conftest import small_config
from tests.flows.test_crash_resume import ROOT
from tests.flows.test_lifecycle import assert_refused, cli, flow_run_count
from tests.conftest import free_port


def write(tmp_path, name: str, **overrides) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(small_config(str(tmp_path / "runs"), name, **overrides)))
    return str(path)


@pytest.mark.slow
def test_what_a_run_needs_from_outside_is_checked_before_step_1(prefect_api, s3_server, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    env_down = write(tmp_path, "env-down", env=[{"id": "reverse-text", "batch_size": 2, "group_size": 4,
                                                 "server": closed, "algorithms": ["grpo", "remote_pkg:Thing"]}])
    vllm_down = write(tmp_path, "vllm-down", inference={"backend": "vllm", "base_url": closed})
    not_a_dir = write(tmp_path, "not-a-dir")
    (tmp_path / "file").write_text("")
    single = write(tmp_path, "single", env=[{"id": "reverse-text", "batch_size": 2, "group_size": 1}])
    before = flow_run_count(prefect_api)

    assert_refused(cli("train", env_down), f"env.0.server = '{closed}' does not answer")
    assert_refused(cli("train", vllm_down), f"inference.base_url = '{closed}' does not answer /v1/models")
    assert_refused(cli("train", not_a_dir, "--set", f"storage={tmp_path / 'file'}"), f"storage = '{tmp_path}/file'")
    assert_refused(cli("train", single, "--dry-run"), "env.0.group_size = 1: a group of one rollout")
    assert flow_run_count(prefect_api) == before

    # S3 storage without credentials (none in the environment, no instance metadata): refused naming storage
    no_credentials = tmp_path / "s3.toml"
    options = {"client_kwargs": {"endpoint_url": s3_server["endpoint_url"]}}
    no_credentials.write_text(tomli_w.dumps(small_config(f"s3://{s3_server['bucket']}/{tmp_path.name}", "s3",
                                                         storage_options=options)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_CONFIG_FILE=str(tmp_path / "none"))
    result = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(no_credentials)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert_refused(result, "storage = 's3://")
    assert "NoCredentialsError" in result.stderr and "storage_options (credentials" in result.stderr


@pytest.mark.slow
def test_a_failed_step_ends_in_one_line_and_the_run_resumes_once_its_cause_is_fixed(prefect_api, tmp_path):
    config = write(tmp_path, "fails", imports=["tests.flows.failing_loss"],
                   trainer={"lr": 1e-3, "loss": {"policy": "fails"}})
    failed = cli("train", config)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == failed.stderr.splitlines()[-1], failed.stderr[-3000:]
    assert "ValueError" in errors[0] and "the loss 'fails' refuses" in errors[0]
    assert f"`trace-rl train {config} --resume`" in errors[0]

    verbose = cli("train", config, "--resume", "--verbose")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    resuming = re.compile(r"INFO +\| trace_rl\.runs\.start - resuming \S+ at step 1\b")  # the library's INFO lines
    assert resuming.search(verbose.stderr), verbose.stderr[-3000:]

    resumed = cli("train", config, "--resume", "--set", "trainer.loss.policy=dppo")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not resuming.search(resumed.stderr)  # not without --verbose
    assert (tmp_path / "runs" / "fails" / "weights" / "000002" / "STABLE").exists()


def test_a_failed_train_says_run_it_again_until_a_step_finished_then_continue_it(tmp_path):
    from flows.cli import build_parser, failure_line
    from trace_rl.storage import RunStorage, step_name

    args = build_parser().parse_args(["train", "run.toml", "--set", "steps=3"])
    command = "`trace-rl train run.toml --set steps=3"
    before = failure_line(ValueError("bad"), args)  # failed before the run's directory was checked
    assert before == f"ValueError: bad; fix that and run {command}` again (--verbose shows the traceback)"
    args.storage = storage = RunStorage.from_url(str(tmp_path / "run"))
    assert failure_line(ValueError("bad"), args) == before  # checked, nothing written yet
    storage.write_json(storage.path("config.toml"), {})
    assert f"fix that and run again with {command} --resume` (no step finished yet)" in failure_line(
        ValueError("bad"), args)
    for kind in ("checkpoints", "weights"):
        storage.mark_stable(storage.path(kind, step_name(1)))
    assert f"fix that and continue the run with {command} --resume`" in failure_line(ValueError("bad"), args)
