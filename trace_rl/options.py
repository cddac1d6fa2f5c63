"""Option models: the empty one, and readable problems from a pydantic ValidationError of an algorithm's, environment's
or loss's own options (each declares its options as a pydantic model named `Options`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class NoOptions(BaseModel):
    """The options of an extension that takes none: any key is refused."""

    model_config = ConfigDict(extra="forbid")


def known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The keys valid at `loc` (the path to the parent of an offending key; list indices skipped), as written in
    TOML: a field's alias where it has one."""
    current: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = _fields_by_key(current).get(part) if current is not None else None
        if field is None:
            return []
        current = _model_in(field.annotation)
    return list(_fields_by_key(current)) if current is not None else []


def _fields_by_key(model: type[BaseModel]) -> dict[str, Any]:
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def option_problems(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per problem, naming the key (with `prefix`) and, for an unknown key, the known ones."""
    problems = []
    for err in exc.errors():
        where = (prefix + ".".join(str(p) for p in err["loc"])).rstrip(".")  # a model-level error has no loc
        if err["type"] == "extra_forbidden":
            known = ", ".join(known_keys(model, tuple(err["loc"][:-1]))) or "none"
            problems.append(f"{where}: unknown key (known keys: {known})")
        else:
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {message}" if where else message)
    return problems
