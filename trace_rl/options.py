"""Readable problems from a pydantic ValidationError of an algorithm's or environment's own options."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError


def option_problems(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per problem, naming the key (with `prefix`) and, for an unknown key, the known ones."""
    problems = []
    for err in exc.errors():
        where = (prefix + ".".join(str(p) for p in err["loc"])).rstrip(".")  # a model-level error has no loc
        if err["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields) or "none"
            problems.append(f"{where}: unknown key (known keys: {known})")
        else:
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {message}" if where else message)
    return problems
