"""Whether the optional `verifiers` package is installed, as the `verifiers` extra of trace-rl pins it."""

from __future__ import annotations

import importlib.metadata

from trace_rl.errors import RefusedError

PINNED = "0.4.0"
INSTALL = "pip install 'trace-rl[verifiers]'"


class VerifiersMissingError(RefusedError):
    """verifiers is not installed, or another version than the one trace-rl's conversion is written for."""


def require_verifiers(what: str) -> None:
    """Raise VerifiersMissingError, one line naming `what` needs it and the extra that installs it, unless
    verifiers `PINNED` is installed. Reads the package's metadata only: cheap, imports nothing."""
    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        raise VerifiersMissingError(f"{what} needs the verifiers package, which is not installed; {INSTALL}") \
            from None
    if version != PINNED:
        raise VerifiersMissingError(f"{what} needs verifiers {PINNED}, but verifiers {version} is installed; "
                                    f"{INSTALL}")
