"""The extension API: the names at the top of `trace_rl`, every import the docs show, and the old module paths."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import trace_rl
from trace_rl.runs.loading import validate_config

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = [
    "Algorithm", "AlgorithmConfig", "AlgorithmError", "Branch", "Channel", "DimensionError", "EnvError", "Environment",
    "Example", "Message", "Sampler", "Trace", "TrainingSample", "aggregate", "channel_stats", "group_traces",
    "load_algorithm", "load_algorithms", "load_env", "read_channels", "register", "register_env", "run_algorithm",
    "run_algorithms", "validate_channels", "write_channels",
]

OLD_MODULES = {
    "trace_rl.trace": "trace_rl.data.trace", "trace_rl.validate": "trace_rl.data.validate",
    "trace_rl.channels": "trace_rl.pipeline.channels", "trace_rl.tiny": "trace_rl.models.tiny",
    "trace_rl.hub": "trace_rl.models.hub", "trace_rl.step": "trace_rl.pipeline.step",
    "trace_rl.session": "trace_rl.pipeline.session", "trace_rl.tracking": "trace_rl.runs.tracking",
}


def test_the_public_names_are_pinned_and_each_is_importable_from_the_top():
    assert sorted(trace_rl.__all__) == PUBLIC, "a public name was added or removed: a decision, so update PUBLIC"
    namespace: dict = {}
    exec(f"from trace_rl import {', '.join(PUBLIC)}", namespace)
    from trace_rl.data.trace import Trace
    from trace_rl.envs import register_env

    assert namespace["Trace"] is Trace and namespace["register_env"] is register_env


def doc_imports() -> list[str]:
    """Every import statement inside a ```python block of the README and docs/."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            statements = re.findall(r"^(?:from \S+ import \([^)]*\)|from \S+ import [^\n]+|import [^\n]+)", block,
                                    flags=re.M)
            found += [s.split("#")[0].strip() for s in statements]
    return found


def test_every_import_in_a_doc_code_block_runs_without_a_deprecated_path():
    imports = doc_imports()
    assert any(line.startswith("from trace_rl import") for line in imports)
    program = "\n".join(dict.fromkeys(imports))
    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:trace_rl.moved", "-c", program], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("old, new", OLD_MODULES.items())
def test_an_old_module_path_imports_the_new_module_with_a_warning_naming_it(old, new):
    program = (f"import warnings; warnings.simplefilter('always')\nimport {old} as old, {new} as new\n"
               "assert old is new")
    run = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"<string>:2: DeprecationWarning: {old} moved to {new}; import it from there" in run.stderr


def test_the_names_of_the_old_models_module_resolve_with_a_warning():
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from trace_rl.models import RuntimeConfig as old_config
        from trace_rl.models import build_runtime as old_build
    assert (old_config, old_build) == (RuntimeConfig, build_runtime)
    assert [str(w.message).split(";")[0] for w in caught if w.category is DeprecationWarning] == [
        "trace_rl.models.RuntimeConfig moved to trace_rl.models.runtime.RuntimeConfig",
        "trace_rl.models.build_runtime moved to trace_rl.inference.build.build_runtime",
    ]
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        trace_rl.models.nothing


ENV_MODULE = '''
from trace_rl import register_env
from trace_rl.envs.reverse_text import ReverseText


@register_env
class Shouting(ReverseText):
    id = "shouting-{suffix}"
'''


def test_imports_lets_a_registered_env_be_named_by_its_short_id(tmp_path, monkeypatch):
    (tmp_path / "my_registered_envs.py").write_text(ENV_MODULE.format(suffix="a"))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"name": "run", "env": [{"id": "shouting-a"}]}
    with pytest.raises(Exception, match="shouting-a"):
        validate_config(config)
    loaded = validate_config({**config, "imports": ["my_registered_envs"]})
    assert loaded.imports == ["my_registered_envs"]
    with pytest.raises(Exception) as info:
        validate_config({**config, "imports": ["no_such_module_here"]})
    assert info.value.problems == [
        "imports.0: module 'no_such_module_here' was not found on sys.path; run trace-rl from the directory that "
        "holds no_such_module_here/ (or no_such_module_here.py), add that directory to PYTHONPATH, or pip install "
        "the package"]


def test_importing_one_module_of_trace_rl_imports_none_of_the_public_names_modules():
    """The reaper (`python -m trace_rl.machine.reaper`) must start in well under a second: the top of the package
    imports its public names' modules only when a name is used."""
    program = ("import sys, trace_rl.machine.reaper\n"
               "loaded = sorted(m for m in sys.modules if m.startswith('trace_rl'))\n"
               "assert loaded == ['trace_rl', 'trace_rl.machine', 'trace_rl.machine.processes', "
               "'trace_rl.machine.reaper'], loaded\n"
               "assert not {'numpy', 'pydantic', 'pyarrow'} & set(sys.modules)")
    run = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
