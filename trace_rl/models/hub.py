"""Model names to local directories: every consumer (sampler, trainer, weight checks) loads the same files.

A model `name` is one of:

- `tiny` / `tiny:<seed>`: built offline into `$TRACE_RL_CACHE` (see `trace_rl.models.tiny`);
- a GGUF checkpoint: a local `.gguf` file or a builtin name (`smollm2-135m`), converted once into a cached
  Hugging Face folder in `$TRACE_RL_CACHE` (see `trace_rl.models.gguf`);
- an existing local directory: used as it is (`revision` is ignored);
- a Hugging Face Hub id (`org/name`): the snapshot directory of `revision` (default `main`) in
  the Hugging Face cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`).
  With `HF_HUB_OFFLINE=1` only the cache is read; online, `huggingface_hub` checks the Hub for
  the revision's commit and downloads what the cache lacks.

Transformers and vLLM are then given the snapshot directory, never the id, so they never
look anything up themselves and the trainer and sampler cannot end up on different files.
Resolution is cached per process: online, only the first call asks the Hub.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

from trace_rl.models.gguf import GGUFError, convert_gguf, existing_converted_dir, gguf_problem, is_gguf_name
from trace_rl.models.tiny import build_tiny, parse_tiny

if TYPE_CHECKING:
    from trace_rl.config import Config


class ModelNotFoundError(FileNotFoundError):
    """A model name that resolves to no local directory; the message says how to get it."""


def hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (not at import, as
    huggingface_hub does), so a process that sets HF_HUB_CACHE after importing it still gets it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (now, or when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def download_hint(name: str, revision: str | None) -> str:
    flag = f" --revision {revision}" if revision else ""
    return (f"`hf download {name}{flag}` (`huggingface-cli download {name}{flag}` with huggingface_hub < 1.0), "
            "then run with HF_HUB_OFFLINE=1 again")


def resolve_model_path(name: str, revision: str | None = None) -> str:
    """A local directory holding the model `name` (at `revision`, for a Hub id); see the module docstring.

    Raises ModelNotFoundError, naming the id, the revision and the fix, when a Hub id cannot be resolved, and
    naming the file and the fix when a GGUF file cannot be converted.
    """
    seed = parse_tiny(name)
    if seed is not None:
        return str(build_tiny(seed))
    if os.path.isdir(name):
        return name
    if is_gguf_name(name):
        try:
            return str(convert_gguf(name))
        except GGUFError as exc:
            raise ModelNotFoundError(str(exc)) from None
    return _snapshot(name, revision or "main", str(hub_cache()), hub_offline())


@functools.lru_cache(maxsize=None)
def _snapshot(repo_id: str, revision: str, cache: str, offline: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline)
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local directory, 'tiny', or a Hugging Face id like 'Qwen/Qwen2.5-0.5B-Instruct' "
            f"({exc})") from None
    except LocalEntryNotFoundError:
        if offline:
            raise ModelNotFoundError(
                f"{repo_id!r} at revision {revision!r} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE "
                f"is set; download it once with {download_hint(repo_id, revision if revision != 'main' else None)}"
            ) from None
        raise ModelNotFoundError(
            f"{repo_id!r} at revision {revision!r}: the Hub could not be reached and it is not in the Hugging Face "
            f"cache ({cache}); check the network, or download it once with "
            f"{download_hint(repo_id, revision if revision != 'main' else None)}") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo_id!r} has no revision {revision!r} on the Hub; use a branch, tag or "
                                 "commit hash listed on its page") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{repo_id!r} is not on the Hub, or is private or gated: check the id, or log in "
                                 "with `hf auth login` and accept its terms on the model page") from None
    except HfHubHTTPError as exc:
        raise ModelNotFoundError(f"{repo_id!r} at revision {revision!r}: the Hub answered {exc}") from None


def local_model_dir(name: str, revision: str | None = None) -> Path | None:
    """The directory of a model already on disk (a local directory, or a Hub id in the cache), without
    downloading or building anything; None otherwise (and for `tiny`). A GGUF file's is its converted folder,
    once converted."""
    if parse_tiny(name) is not None:
        return None
    if os.path.isdir(name):
        return Path(name)
    if is_gguf_name(name):
        return existing_converted_dir(name)
    try:
        return Path(_snapshot(name, revision or "main", str(hub_cache()), True))
    except (ModelNotFoundError, ValueError):
        return None


def hub_problem(name: str, revision: str | None = None) -> str | None:
    """Config-time check (no torch, no network): why `name` cannot be loaded, or None.

    Offline, a Hub id must be in the cache. Online, a missing id is fine here: it downloads when
    the run starts (and a wrong one fails there, with the Hub's answer).
    """
    if parse_tiny(name) is not None or os.path.isdir(name):
        return None
    if is_gguf_name(name):
        return gguf_problem(name)
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return (f"{name!r} is neither 'tiny', an existing local directory, a .gguf file, nor a Hugging Face id like "
                "'Qwen/Qwen2.5-0.5B-Instruct'; fix the path or the id")
    if not hub_offline():
        return None
    try:
        resolve_model_path(name, revision)
    except ModelNotFoundError as exc:
        return str(exc)
    return None


def check_models(config: Config) -> list[str]:
    """Config-time check of every token-capable model's name (tokenless ones are never loaded here)."""
    models = [("model", config.model), *((f"models.{key}", m) for key, m in config.models.items() if m.tokens)]
    problems = []
    for where, model in models:
        problem = hub_problem(model.name, model.revision)
        if problem:
            problems.append(f"{where}.name: {problem}")
    return problems
