"""The layers of the tree, read from the code's own imports (those inside functions included):

- the library (`trace_rl/`) imports nothing of the orchestration above it (`flows/`, Prefect), and the
  tasks (`flows/tasks.py`) import no flow;
- no module imports one that imports it back, however long the loop;
- the library's folders are layers: no folder imports one that imports it back, so an arrow never runs up;
- the data model (`trace_rl/data/`) sits on the ground floor, under everything that reads or writes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trace_rl", "flows")
GROUND_FLOOR = {"trace_rl.names", "trace_rl.errors"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imported(name: str) -> set[str]:
    """Modules of this tree that module `name` imports anywhere in it (in functions too); `from a import b`
    counts as an import of `a.b` where that is a module, and of `a` otherwise."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                      for alias in node.names}
    return {module for module in found if module in MODULES}


def parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def module_graph() -> dict[str, set[str]]:
    """Who imports whom. `import a.b.c` also runs the packages `a` and `a.b`, unless they hold the importer."""
    graph = {}
    for name in MODULES:
        targets = imported(name)
        graph[name] = targets | {pkg for target in targets for pkg in parents(target)
                                 if pkg in MODULES and not f"{name}.".startswith(f"{pkg}.")}
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, str] = {}
    found = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def folder(module: str) -> str:
    """The layer a module belongs to: its folder under trace_rl/ (a top-level module is a layer of its own)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_library_imports_no_prefect_flows_or_tasks_and_tasks_no_flows():
    def forbidden(name: str, roots: set[str]) -> list[str]:
        every = set()
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            if isinstance(node, ast.Import):
                every |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                every.add(node.module)
        return sorted(m for m in every if m.split(".")[0] in roots)

    offenders = {name: forbidden(name, {"prefect", "flows"}) for name in MODULES if name.startswith("trace_rl")}
    offenders["flows.tasks"] = forbidden("flows.tasks", {"flows"})
    assert {name: found for name, found in offenders.items() if found} == {}


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(module_graph()) == []


def test_the_library_folders_are_layers_without_an_arrow_back_up():
    graph: dict[str, set[str]] = {}
    for name, targets in module_graph().items():
        if name.startswith("trace_rl."):
            graph.setdefault(folder(name), set()).update(
                folder(t) for t in targets if t.startswith("trace_rl.") and folder(t) != folder(name))
    assert cycles(graph) == []


def test_the_data_model_is_the_ground_floor():
    data = {name for name in MODULES if name.startswith("trace_rl.data")}
    assert {"trace_rl.data.trace", "trace_rl.data.channel", "trace_rl.data.sample"} <= data
    assert {name: sorted(imported(name) - data - GROUND_FLOOR) for name in data} == {name: [] for name in data}


def test_config_imports_only_leaf_modules():
    """The schema sits near the bottom: what it imports of trace_rl imports nothing further but the ground floor."""
    used = imported("trace_rl.config")
    assert used and not any(name.startswith("trace_rl.algorithms") for name in used)
    assert {name: imported(name) - GROUND_FLOOR for name in used} == {name: set() for name in used}
