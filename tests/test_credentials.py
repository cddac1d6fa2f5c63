"""Credentials in `storage_options` never reach config.toml, flow parameters or the config hash, and the run's
storage still gets the real values (a real S3 server for the last tests). With a Prefect server:
tests/flows/test_credentials.py."""

from __future__ import annotations

import json
import tomllib

import pytest
from pydantic import SecretStr

from trace_rl.config import Config, config_hash, config_to_toml, parse_config
from trace_rl.credentials import REVEAL, CredentialError, is_credential_key
from trace_rl.storage import RunStorage

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY-SECRET"
ACCESS_KEY = "AKIA-EXAMPLE-ACCESS-KEY"
SESSION_TOKEN = "FwoGZXIvYXdzE-SESSION-TOKEN"


def s3_config(secret: str = SECRET, endpoint: str = "http://127.0.0.1:9", prefix: str = "runs", **options) -> Config:
    return parse_config({
        "name": "secret-run", "storage": f"s3://trace-rl-test/{prefix}", "env": [{"id": "reverse-text"}],
        "storage_options": {"key": ACCESS_KEY, "secret": secret,
                            "client_kwargs": {"endpoint_url": endpoint, "aws_session_token": SESSION_TOKEN},
                            **options},
    })


def assert_no_secret(text: str) -> None:
    for value in (SECRET, ACCESS_KEY, SESSION_TOKEN, "other-secret"):
        assert value not in text


def test_credential_keys_are_recognised_by_name():
    for key in ("key", "secret", "token", "password", "aws_secret_access_key", "aws_access_key_id",
                "aws_session_token", "api_key", "apiKey", "sse_customer_key", "account_key", "client_secret",
                "connection_string", "sas_token", "credentials"):
        assert is_credential_key(key), key
    for key in ("endpoint_url", "region_name", "anon", "use_ssl", "requester_pays", "default_block_size", "profile"):
        assert not is_credential_key(key), key


def test_secrets_are_held_as_secret_str_and_left_out_of_config_toml_and_the_json_form():
    config = s3_config()
    options = config.storage_options
    assert isinstance(options["secret"], SecretStr) and options["secret"].get_secret_value() == SECRET
    assert isinstance(options["client_kwargs"]["aws_session_token"], SecretStr)
    assert options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9"
    assert SECRET not in repr(config) and SECRET not in str(options)

    text = config_to_toml(config)
    assert_no_secret(text)
    back = parse_config(tomllib.loads(text))
    assert back.storage_options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert config_to_toml(back) == text  # a resumed run compares these: unchanged

    dumped = config.model_dump(mode="json")  # what Prefect stores as flow parameters
    assert_no_secret(json.dumps(dumped))
    assert_no_secret(config.model_dump_json())


def test_the_config_hash_does_not_depend_on_secret_values():
    assert config_hash(s3_config(SECRET)) == config_hash(s3_config("other-secret"))
    assert config_hash(s3_config(SECRET)) != config_hash(s3_config(SECRET, endpoint="http://127.0.0.1:10"))
    assert config_hash(s3_config("env:A")) != config_hash(s3_config("env:B"))  # where it is read from counts


def test_python_dumps_keep_the_secret_and_a_reveal_context_writes_it_for_child_processes():
    config = s3_config()
    again = Config(**config.model_dump())
    assert again.storage_options["secret"].get_secret_value() == SECRET
    revealed = Config.model_validate_json(config.model_dump_json(context={REVEAL: True}))
    assert revealed.storage_options["secret"].get_secret_value() == SECRET
    assert config_hash(revealed) == config_hash(config)


def test_an_env_reference_is_kept_as_written_and_read_when_the_filesystem_is_built(monkeypatch):
    config = s3_config("env:TRACE_RL_TEST_S3_SECRET")
    assert config.storage_options["secret"] == "env:TRACE_RL_TEST_S3_SECRET"
    assert 'secret = "env:TRACE_RL_TEST_S3_SECRET"' in config_to_toml(config)
    monkeypatch.delenv("TRACE_RL_TEST_S3_SECRET", raising=False)
    with pytest.raises(CredentialError, match="storage_options.secret = 'env:TRACE_RL_TEST_S3_SECRET': the "
                                              "environment variable TRACE_RL_TEST_S3_SECRET is not set"):
        RunStorage.of(config)
    monkeypatch.setenv("TRACE_RL_TEST_S3_SECRET", SECRET)
    storage = RunStorage.of(config)
    assert storage.fs.secret == SECRET and storage.fs.key == ACCESS_KEY


def test_a_prefect_secret_reference_outside_the_flows_names_the_fix():
    from trace_rl import credentials

    readers = dict(credentials._READERS)
    credentials._READERS.clear()  # as in a process that never imported `flows`
    try:
        config = s3_config("prefect-secret:s3-secret")
        with pytest.raises(CredentialError, match="Prefect Secret blocks are read only inside trace-rl's flows"):
            RunStorage.of(config)
    finally:
        credentials._READERS.update(readers)


def test_a_run_on_s3_works_with_its_secret_which_stays_out_of_its_files(s3_server, tmp_path, monkeypatch):
    from tests.data.test_trace import make_trace
    from trace_rl.config import AlgorithmConfig
    from trace_rl.offline.replay import replay_config, source_config
    from trace_rl.runs.start import prepare_run
    from trace_rl.tables import read_traces, write_traces

    monkeypatch.setenv("TRACE_RL_TEST_S3_SECRET", SECRET)
    for secret in (SECRET, "env:TRACE_RL_TEST_S3_SECRET"):
        config = s3_config(secret, endpoint=s3_server["endpoint_url"], prefix=f"{tmp_path.name}-{len(secret)}")
        storage, first = prepare_run(config, "new")
        assert first == 1 and storage.fs.secret == SECRET and storage.fs.key == ACCESS_KEY
        write_traces(storage, 1, [make_trace("t0")])
        assert [t.id for t in read_traces(storage, 1)] == ["t0"]
        assert_no_secret(storage.read_bytes(storage.path("config.toml")).decode())

        # replay reads the saved config.toml (no secret in it) with the options it is given
        source = source_config(storage.url, config.storage_options)
        replayed = replay_config(source, [AlgorithmConfig(id="rl")])
        assert RunStorage.of(replayed).fs.secret == SECRET


def test_the_secrets_a_text_must_not_show_are_found_and_redacted(monkeypatch):
    from trace_rl.credentials import environment_secrets, redact, secrets_in

    monkeypatch.setenv("MY_SECRET", "from-the-environment")
    options = [s3_config().storage_options, {"api_key": "judge-key", "endpoint": "http://x", "nested": {
        "password": "env:MY_SECRET", "token": "env:NOT_SET_ANYWHERE"}}, {"model": "tiny", "tokens": True}]
    assert secrets_in(options) == {ACCESS_KEY, SECRET, SESSION_TOKEN, "judge-key", "from-the-environment"}
    assert environment_secrets({"HF_TOKEN": "hf_abcdefgh", "USE_KEY": "1", "HOME": "/home/me-and-more"}) == {
        "hf_abcdefgh"}
    assert redact(f"a {SECRET} b judge-key", {SECRET, "judge-key", SECRET[:5]}) == "a [secret] b [secret]"
