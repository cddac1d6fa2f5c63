"""Importing the `package.module:Name` paths a config names (a user's env, algorithm or reward function)."""

from __future__ import annotations

import importlib
from typing import Any


class ImportPathError(Exception):
    """A `package.module:Name` path that does not import, said as `<what> '<path>': <problem>; <fix>`.
    `missing_module`: the module itself is not there (rather than failing to import, or lacking the name)."""

    def __init__(self, message: str, missing_module: bool = False):
        super().__init__(message)
        self.missing_module = missing_module


def module_is_missing(module_name: str, exc: ModuleNotFoundError) -> bool:
    """Whether `exc` says `module_name` itself (or a package above it) is not there, rather than a module it
    imports failing (a missing dependency: that is an error of the module, reported as such)."""
    return exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + "."))


def not_on_path(module_name: str) -> str:
    """What to say of a module that is not there, with the fix."""
    top = module_name.split(".")[0]
    return (f"module {module_name!r} was not found on sys.path; run trace-rl from the directory that holds "
            f"{top}/ (or {top}.py), add that directory to PYTHONPATH, or pip install the package")


def import_modules(names: list[str], where: str = "imports") -> list[str]:
    """Import each module (its `@register_env` and `@register` decorators run); the problems, one per module that
    is not there or fails to import."""
    problems = []
    for index, name in enumerate(names):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            fix = not_on_path(name) if module_is_missing(name, exc) else f"it imports a module that is missing: {exc}"
            problems.append(f"{where}.{index}: {fix}")
        except Exception as exc:  # any error raised while the module runs
            problems.append(f"{where}.{index}: importing module {name!r} failed: {type(exc).__name__}: {exc}; fix "
                            "the module or install its dependencies")
    return problems


def import_path(path: str, what: str) -> Any:
    """The object a `package.module:Name` path names (the module itself for a path without `:Name`); `what` names
    it in the error (`env`, `reward`, `algorithm`, ...)."""
    module_name, colon, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if module_is_missing(module_name, exc):
            raise ImportPathError(f"{what} {path!r}: {not_on_path(module_name)}", missing_module=True) from None
        raise ImportPathError(f"{what} {path!r}: importing module {module_name!r} failed: {type(exc).__name__}: "
                              f"{exc}; install the missing package or fix the module") from exc
    except Exception as exc:  # an ImportError or any error raised while the module runs
        raise ImportPathError(f"{what} {path!r}: importing module {module_name!r} failed: {type(exc).__name__}: "
                              f"{exc}; fix the module or install its dependencies") from exc
    if not colon:
        return module
    if not hasattr(module, name):
        raise ImportPathError(f"{what} {path!r}: module {module_name!r} has no attribute {name!r}; check the name "
                              "after ':'")
    return getattr(module, name)
