"""Modules and names that moved: their old import paths keep working for one release, with a DeprecationWarning
that names the new place. Each old module is a file of two lines at its old path (e.g. `trace_rl/trace.py`)."""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

REMOVED_IN = "trace-rl 0.2"


def warn_moved(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there, the old path goes in {REMOVED_IN}",
                  DeprecationWarning, stacklevel=stacklevel + 1)


def alias_module(old: str, new: ModuleType) -> None:
    """Make the module being imported as `old` the module `new`, warning the importer (import machinery's own
    frames are skipped by `warnings`, so the warning points at the line that imported `old`)."""
    warn_moved(old, new.__name__, stacklevel=3)
    sys.modules[old] = new


def moved_name(old_module: str, name: str, moved: dict[str, str]) -> object:
    """A package's `__getattr__` (PEP 562) for names it lost: `moved` maps each to the module that holds it now,
    imported only when the old name is used, then kept in the package (one warning per name)."""
    if name not in moved:
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
    warn_moved(f"{old_module}.{name}", f"{moved[name]}.{name}", stacklevel=3)
    value = getattr(importlib.import_module(moved[name]), name)
    setattr(sys.modules[old_module], name, value)
    return value
