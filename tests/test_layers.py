"""The layers of the tree: the library never imports the orchestration above it, and its modules import
each other without cycles (at module level), so each can be read and tested from the bottom up."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, everywhere: bool) -> set[str]:
    """Modules `path` imports: at module level only, or anywhere in it (functions included)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if everywhere else tree.body
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


LIBRARY = {module_name(p): p for p in (ROOT / "trace_rl").rglob("*.py")}


def test_the_library_imports_no_prefect_flows_or_tasks():
    offenders = {name: sorted(m for m in imports(path, everywhere=True)
                              if m.split(".")[0] in {"prefect", "flows", "tasks"})
                 for name, path in LIBRARY.items()}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_library_modules_import_each_other_without_cycles():
    graph = {name: {m for m in imports(path, everywhere=False) if m in LIBRARY} for name, path in LIBRARY.items()}
    for name in graph:  # `import a.b.c` also runs the packages a and a.b (unless they hold the importer)
        graph[name] |= {pkg for m in list(graph[name]) for pkg in parents(m)
                        if pkg in LIBRARY and not f"{name}.".startswith(f"{pkg}.")}
    state: dict[str, str] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_config_imports_only_leaf_modules():
    """The schema sits at the bottom: what it imports of trace_rl imports nothing further but errors and names."""
    def library_imports(name: str) -> set[str]:
        return {m for m in imports(LIBRARY[name], everywhere=True) if m.startswith("trace_rl")}

    used = library_imports("trace_rl.config")
    assert used and "trace_rl.algorithms.base" not in used
    assert {name: library_imports(name) - {"trace_rl.errors", "trace_rl.names"} for name in used} == {
        name: set() for name in used}
