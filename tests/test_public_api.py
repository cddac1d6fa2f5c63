"""The extension API: the names at the top of `trace_rl`, every import the docs show, and the pipeline's plumbing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import trace_rl
from trace_rl.runs.loading import validate_config

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = [
    "Algorithm", "AlgorithmConfig", "AlgorithmError", "Branch", "Channel", "Conversation", "EnvError", "Environment",
    "Example", "LossError", "Message", "ModelRuntime", "NoOptions", "PolicyLoss", "PolicyTokens", "RetryableError",
    "Sampler", "Trace", "TrainingSample", "apply_algorithm", "group_traces", "load_algorithm", "load_env", "ok_traces",
    "register_algorithm", "register_env", "register_loss", "sampled_mask", "set_on_sampled",
]


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


def test_every_import_in_a_doc_code_block_runs():
    imports = doc_imports()
    assert any(line.startswith("from trace_rl import") for line in imports)
    program = "\n".join(dict.fromkeys(imports))
    run = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def extension_examples() -> dict[str, str]:
    """The docs' extension examples: each ```python block that imports from `trace_rl` and defines a class, as a
    module's source, by a module name made of its page and position."""
    found = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        for index, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)):
            if "from trace_rl import" in block and re.search(r"(?m)^class ", block):
                found[f"{page.stem}_example_{index}"] = block
    return found


def mypy(folder: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                           str(cache), str(folder)], cwd=ROOT, capture_output=True, text=True)


def test_the_docs_extension_examples_type_check_and_a_wrong_attribute_fails(tmp_path):
    examples = extension_examples()
    assert {"algorithms", "envs", "remote", "trainer"} <= {name.split("_example_")[0] for name in examples}
    good, bad = tmp_path / "good", tmp_path / "bad"
    for folder in (good, bad):
        folder.mkdir()
    for name, source in examples.items():
        (good / f"{name}.py").write_text(source)
    checked = mypy(good, tmp_path / "cache")
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert f"no issues found in {len(examples)} source files" in checked.stdout
    # the same examples with an attribute misspelled: one on trace-rl's types, one on the example's own options
    [algorithm] = [source for name, source in examples.items() if name.startswith("algorithms_")]
    wrong = algorithm.replace("for branch in trace.branches:", "for branch in trace.branchs:").replace(
        "self.options.per_token", "self.options.per_tokn")
    (bad / "algorithm.py").write_text(wrong)
    failed = mypy(bad, tmp_path / "cache")
    assert failed.returncode == 1
    assert '"Trace" has no attribute "branchs"' in failed.stdout, failed.stdout
    assert '"LengthPenaltyOptions" has no attribute "per_tokn"' in failed.stdout, failed.stdout


def test_the_type_checking_mirror_names_every_public_name_as_the_object_it_resolves_to():
    import ast

    tree = ast.parse(Path(trace_rl.__file__).read_text())
    [mirror] = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    named = {alias.name: node.module for node in mirror.body for alias in node.names}
    assert sorted(named) == PUBLIC
    for name, module in named.items():
        assert getattr(trace_rl, name) is getattr(__import__(module, fromlist=[name]), name), name


def test_the_pipelines_plumbing_is_trace_rl_pipelines():
    import trace_rl.pipeline as pipeline
    from trace_rl.tables import read_channels

    assert pipeline.__all__ == ["DimensionError", "apply_algorithms", "channel_stats", "load_algorithms",
                                "read_channels", "sum_channels", "validate_channels", "write_channels"]
    assert pipeline.read_channels is read_channels
    assert not {"read_channels", "channel_stats", "validate_channels"} & set(trace_rl.__all__)


ENV_MODULE = '''
from trace_rl import register_env
from trace_rl.envs.reverse_text import ReverseText


@register_env("shouting-{suffix}")
class Shouting(ReverseText):
    """reverse-text under another id."""
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
               "'trace_rl.machine.reaper', 'trace_rl.machine.temp_folders', 'trace_rl.version'], loaded\n"
               "assert not {'numpy', 'pydantic', 'pyarrow'} & set(sys.modules)")
    run = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
