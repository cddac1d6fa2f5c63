"""Credentials in a run's config, kept out of everything a run writes or shows.

A `storage_options` value whose key names a credential (`key`, `secret`, `token`, `password`,
`api_key`, `client_kwargs.aws_secret_access_key`, any key ending in `_key` ...; see
`is_credential_key`) is held as a pydantic `SecretStr`. The config's JSON form leaves it out:
that is what `config.toml`, Prefect flow parameters and the config hash are made of, so a
secret is never stored with the run and rotating it does not change the hash (a resumed run
still finds its finished stages). Python objects keep it (`model_dump()`, `model_copy`), and
`resolve` reveals it where a filesystem is built (`RunStorage`, the Prefect result storage).

Instead of a value, an option may say where to read it; such a reference is kept as written
(it is not secret itself) and read each time a filesystem is built:
  - `env:NAME`: the environment variable NAME;
  - `prefect-secret:NAME`: the Prefect Secret block NAME, read by the flows layer, which
    registers the reader (`register_reader`) when `flows` is imported.
With neither, fsspec's own fallbacks apply (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, ~/.aws/credentials).

Texts a run shows (the rollout table in the UI) pass through `redact` with the secrets `secrets_in` finds in the
config's options and `environment_secrets` in the environment.

This module imports nothing of trace_rl but `trace_rl.errors` (the config schema uses it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, PlainSerializer, SecretStr, SerializationInfo

from trace_rl.errors import RefusedError

CREDENTIAL_WORDS = ("secret", "token", "password", "passwd", "credential", "apikey", "access_key",
                    "connection_string")
REFERENCE_PREFIXES = ("env:", "prefect-secret:")
REVEAL = "reveal_credentials"  # serialization context key: `model_dump_json(context={REVEAL: True})`

REDACTED = "[secret]"
MIN_SECRET_CHARS = 8  # of an environment variable's value, to be taken for a secret (`environment_secrets`)

_READERS: dict[str, Callable[[str], str]] = {}


class CredentialError(RefusedError):
    """A credential reference that cannot be read; the message names the option and the fix (the CLI prints
    it alone and exits with 2, before any flow run starts)."""


def is_credential_key(key: str) -> bool:
    """`key`, anything ending in `_key` (`api_key`, `sse_customer_key`), or containing one of CREDENTIAL_WORDS."""
    name = str(key).lower().replace("-", "_")
    return name == "key" or name.endswith("_key") or any(word in name for word in CREDENTIAL_WORDS)


def is_reference(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(REFERENCE_PREFIXES)


def hide(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with each string under a credential key (at any depth) as a SecretStr; references stay."""
    return _hide(options, secret=False)


def _hide(options: dict[str, Any], secret: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options.items():
        inner = secret or is_credential_key(key)
        if isinstance(value, dict):
            out[key] = _hide(value, inner)
        elif inner and isinstance(value, str) and not is_reference(value):
            out[key] = SecretStr(value)
        else:
            out[key] = value
    return out


def public(options: dict[str, Any]) -> dict[str, Any]:
    """`options` without its secret values (their keys left out); references and everything else stay."""
    return {key: public(value) if isinstance(value, dict) else value
            for key, value in options.items() if not isinstance(value, SecretStr)}


def resolve(options: dict[str, Any], where: str = "storage_options") -> dict[str, Any]:
    """Plain options for fsspec: secrets revealed, `env:` and `prefect-secret:` references read."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, dict):
            out[key] = resolve(value, f"{where}.{key}")
        elif isinstance(value, SecretStr):
            out[key] = value.get_secret_value()
        elif is_reference(value):
            out[key] = read_reference(value, f"{where}.{key}")
        else:
            out[key] = value
    return out


def read_reference(reference: str, where: str) -> str:
    kind, _, name = reference.partition(":")
    if kind == "env":
        if name not in os.environ:
            raise CredentialError(f"{where} = {reference!r}: the environment variable {name} is not set; "
                                  f"export it before starting the run")
        return os.environ[name]
    reader = _READERS.get(kind)
    if reader is None:
        raise CredentialError(f"{where} = {reference!r}: Prefect Secret blocks are read only inside trace-rl's flows "
                              f"(`trace-rl train`, `replay`, `serve`); use 'env:<VARIABLE>' here instead")
    try:
        return reader(name)
    except Exception as exc:  # noqa: BLE001  (any failure to read it is the reference's problem)
        raise CredentialError(f"{where} = {reference!r}: cannot read it ({type(exc).__name__}: {exc}); "
                              f"create the Secret block {name!r} or fix the name") from None


def secrets_in(data: Any, secret: bool = False) -> set[str]:
    """The secret values in `data` (e.g. a config's `model_dump()`), at any depth: SecretStr values, strings under a
    credential key, and what their `env:` and `prefect-secret:` references read where they can be read."""
    if isinstance(data, SecretStr):
        return {data.get_secret_value()} - {""}
    if isinstance(data, dict):
        return set().union(*(secrets_in(value, secret or is_credential_key(key)) for key, value in data.items()))
    if isinstance(data, (list, tuple)):
        return set().union(*(secrets_in(value, secret) for value in data))
    if not (secret and isinstance(data, str) and data):
        return set()
    if not is_reference(data):
        return {data}
    try:
        return {read_reference(data, "")} - {""}
    except CredentialError:  # nothing it could reveal
        return set()


def environment_secrets(environ: Mapping[str, str] = os.environ) -> set[str]:
    """The values of environment variables named like a credential (`AWS_SECRET_ACCESS_KEY`, `HF_TOKEN`,
    `WANDB_API_KEY`, the env server's token) of at least MIN_SECRET_CHARS characters: shorter ones are flags and
    numbers, which redacting would blank out of every text."""
    return {value for name, value in environ.items() if is_credential_key(name) and len(value) >= MIN_SECRET_CHARS}


def redact(text: str, secrets: Iterable[str]) -> str:
    """`text` with each occurrence of a secret replaced by REDACTED, the longest secrets first."""
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


def register_reader(kind: str, reader: Callable[[str], str]) -> None:
    """Let `<kind>:NAME` references be read by `reader(NAME)` (the flows layer registers `prefect-secret`)."""
    _READERS[kind] = reader


def _serialize(options: dict[str, Any], info: SerializationInfo) -> dict[str, Any]:
    if info.context and info.context.get(REVEAL):
        return resolve(options)
    return public(options)


StorageOptions = Annotated[
    dict[str, Any],
    AfterValidator(hide),
    PlainSerializer(_serialize, when_used="json"),
]
"""fsspec options whose credentials are SecretStr: left out of JSON, unless serialized with context {REVEAL: True}
(only for a child process that needs them, e.g. the trainer's torchrun workers)."""
