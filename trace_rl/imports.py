"""Importing the `package.module:Name` paths a config names (a user's env, algorithm or reward function)."""

from __future__ import annotations

import importlib


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
