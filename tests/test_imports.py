"""One `package.module:Name` resolver (trace_rl.imports.import_path) behind every place a config or command line
names a user's code, each saying what failed in the same shape: `<what> '<path>': <problem>; <fix>`."""

from __future__ import annotations

import pytest

from trace_rl.algorithms.base import AlgorithmError
from trace_rl.algorithms.echo import resolve_filter
from trace_rl.algorithms.lookup import load_algorithm
from trace_rl.envs.base import EnvError, import_named
from trace_rl.imports import ImportPathError, import_path
from trace_rl.remote.server import EnvServerError, import_allowed

BROKEN = "raise RuntimeError('boom at import')\n"


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    (tmp_path / "user_code.py").write_text("def score(text):\n    return 1.0\n\nVALUE = 3\n")
    (tmp_path / "user_broken.py").write_text(BROKEN)
    (tmp_path / "user_needs_dep.py").write_text("import trace_rl_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_import_path_names_the_object_or_the_module(user_modules):
    import user_code

    assert import_path("user_code:score", "reward") is user_code.score
    assert import_path("user_code", "--allow") is user_code


@pytest.mark.parametrize("path, problem, missing", [
    ("user_nowhere:X", "module 'user_nowhere' was not found on sys.path; run trace-rl from the directory", True),
    ("user_code:nothing", "module 'user_code' has no attribute 'nothing'; check the name after ':'", False),
    ("user_broken:X", "importing module 'user_broken' failed: RuntimeError: boom at import; fix the module", False),
    ("user_needs_dep:X", "importing module 'user_needs_dep' failed: ModuleNotFoundError: No module named "
                         "'trace_rl_no_such_dependency'; install the missing package", False),
])
def test_every_caller_says_a_failed_import_in_one_shape(user_modules, path, problem, missing):
    with pytest.raises(ImportPathError) as raised:
        import_path(path, "thing")
    assert str(raised.value).startswith(f"thing {path!r}: {problem}") and raised.value.missing_module == missing
    callers = [(lambda: import_named(path, "env"), EnvError, "env"),
               (lambda: resolve_filter(path), AlgorithmError, "echo filter"),
               (lambda: import_allowed([path]), EnvServerError, "--allow"),
               (lambda: load_algorithm(path), AlgorithmError, "algorithm")]
    for call, error, what in callers:
        with pytest.raises(error) as raised:
            call()
        assert str(raised.value).startswith(f"{what} {path!r}: {problem}")


def test_an_allowed_name_that_is_not_a_class_is_refused(user_modules):
    with pytest.raises(EnvServerError, match="--allow 'user_code:score': not an Algorithm or Environment class"):
        import_allowed(["user_code:score"])
