"""Prefect flows: a training run (`train`), one step (`train_step`) and offline replay (`replay`).

Importing `flows` lets `storage_options` read credentials from Prefect Secret blocks
(`secret = "prefect-secret:<block name>"`, see trace_rl/credentials.py and docs/storage.md).
"""

from trace_rl import credentials


def read_prefect_secret(name: str) -> str:
    """The value of the Prefect Secret block `name` (from the Prefect server the flows use)."""
    from prefect.blocks.system import Secret

    return str(Secret.load(name, _sync=True).get())


credentials.register_reader("prefect-secret", read_prefect_secret)
