"""Credentials against a real Prefect server: flow parameters hold no secret, `prefect-secret:` references read
Secret blocks, and the run's result-storage block is saved without the secret while this process's copy keeps
it (a real S3 server)."""

from __future__ import annotations

import json

from trace_rl.config import parse_config
from trace_rl.storage import RunStorage

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY-SECRET"


def s3_config(s3_server, prefix: str, secret: str):
    return parse_config({
        "name": "secret-run", "storage": f"s3://{s3_server['bucket']}/{prefix}", "env": [{"id": "reverse-text"}],
        "storage_options": {"key": "AKIA-EXAMPLE", "secret": secret,
                            "client_kwargs": {"endpoint_url": s3_server["endpoint_url"]}},
    })


def test_flow_parameters_hold_no_secret(prefect_api, s3_server):
    from flows.step import step_flow
    from flows.train import train_flow

    config = s3_config(s3_server, "params", SECRET)
    assert config.storage_options["secret"].get_secret_value() == SECRET
    for parameters in (train_flow.serialize_parameters({"config": config, "mode": "new"}),
                       step_flow.serialize_parameters({"config": config, "step": 1})):
        assert SECRET not in json.dumps(parameters)
        assert parameters["config"]["storage_options"] == {"client_kwargs": {"endpoint_url": s3_server["endpoint_url"]}}


def test_a_prefect_secret_reference_reads_the_secret_block(prefect_api, s3_server, tmp_path):
    from prefect.blocks.system import Secret

    import flows  # noqa: F401  (registers the prefect-secret reader)

    Secret(value=SECRET).save("trace-rl-test-s3-secret", overwrite=True)
    config = s3_config(s3_server, tmp_path.name, "prefect-secret:trace-rl-test-s3-secret")
    assert config.storage_options["secret"] == "prefect-secret:trace-rl-test-s3-secret"
    storage = RunStorage.of(config)
    assert storage.fs.secret == SECRET
    storage.write_atomic(storage.path("hello.txt"), b"hi")
    assert storage.read_bytes(storage.path("hello.txt")) == b"hi"


def test_the_saved_result_storage_block_holds_no_secret(prefect_api, s3_server, tmp_path):
    from prefect.filesystems import RemoteFileSystem

    from flows.caching import saved_result_storage

    config = s3_config(s3_server, tmp_path.name, SECRET)
    block = saved_result_storage(RunStorage.of(config))
    assert block.settings["secret"] == SECRET  # what this process's tasks write results with
    saved = RemoteFileSystem.load(block._block_document_name)
    assert saved.settings == {"client_kwargs": {"endpoint_url": s3_server["endpoint_url"]}}
    block.write_path("result.json", b"{}")
    storage = RunStorage.of(config)
    assert storage.read_bytes(storage.path("prefect", "results", "result.json")) == b"{}"
