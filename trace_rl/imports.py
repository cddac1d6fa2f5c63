"""Importing the `package.module:Name` paths a config names (a user's env, algorithm or reward function)."""

from __future__ import annotations


def module_is_missing(module_name: str, exc: ModuleNotFoundError) -> bool:
    """Whether `exc` says `module_name` itself (or a package above it) is not there, rather than a module it
    imports failing (a missing dependency: that is an error of the module, reported as such)."""
    return exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + "."))


def not_on_path(module_name: str) -> str:
    """What to say of a module that is not there, with the fix."""
    top = module_name.split(".")[0]
    return (f"module {module_name!r} was not found on sys.path; run trace-rl from the directory that holds "
            f"{top}/ (or {top}.py), add that directory to PYTHONPATH, or pip install the package")
