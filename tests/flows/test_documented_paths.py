"""Every path of a run that README.md and docs/ name exists, spelled the same, in a real finished run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.flows.conftest import small_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = r"(?:config\.toml|replay\.json|(?:steps|checkpoints|weights|plots|prefect)(?:/[^`\s]*)?)"
# a run path in backticks, as `steps/<step>/batch.parquet` or `runs/<name>/steps/...` or `<storage>/<name>/...`
INLINE = re.compile(rf"`(?:(?:runs|<storage>)/(?:<name>|demo)/)?({TOP})`")
# a step is six digits: the placeholders, and examples such as `steps/000030/` (whichever step they show)
PLACEHOLDERS = [("<step:06d>", r"\d{6}"), ("<step>", r"\d{6}"), ("<s>", r"\d{6}"), ("<s-1>", r"\d{6}"),
                ("<NN>", r"\d{2}"), ("<algorithm>", r"[^/]+"), ("<id>", r"[^/]+"), ("*", r"[^/]*")]
# written only by some runs: a stateful algorithm's state (rae), the record of a replay's --out, a tracker's run id
# and the rollouts in flight of a run with partial rollouts (tests/flows/test_partial_runs.py checks it is written)
ONLY_SOME_RUNS = {"steps/<step>/channels/<NN>-<algorithm>.state.json", "replay.json", "tracking/<backend>.json",
                  "steps/<step>/in_flight.json", "steps/<s>/in_flight.json"}


def layout_paths(text: str) -> set[str]:
    """The paths of storage.md's layout block: `<storage>/<name>/` and the tree below it, two spaces a level."""
    block = text.split("<storage>/<name>/\n", 1)[1].split("```", 1)[0]
    paths, parents = set(), {}
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        words = line.split()
        if not words or indent > 8:  # a description continued on the next line
            continue
        entries = [words[0]]  # `prefect/cache/, prefect/results/` names two
        for word in words[1:]:
            if not entries[-1].endswith(","):
                break
            entries.append(word)
        parent = parents.get(indent - 2, "")
        paths |= {parent + entry.rstrip(",") for entry in entries}
        if len(entries) == 1 and entries[0].endswith("/"):
            parents[indent] = parent + entries[0]
    return paths


def documented_paths() -> dict[str, set[str]]:
    """Each run path the docs name, with the files that name it."""
    found: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        paths = {m.group(1) for m in INLINE.finditer(text)}
        if doc.name == "storage.md":
            paths |= layout_paths(text)
        for path in paths:
            found.setdefault(path, set()).add(str(doc.relative_to(ROOT)))
    return found


def pattern(path: str) -> re.Pattern:
    text = re.sub(r"(?<![0-9])[0-9]{6}(?![0-9])", "<step>", path)
    text = re.escape(text)
    for placeholder, regex in PLACEHOLDERS:
        text = text.replace(re.escape(placeholder), regex)
    return re.compile(text + ("" if path.endswith("/") else "/?"))


@pytest.fixture(scope="module")
def run_files(prefect_api, tmp_path_factory) -> list[str]:
    """Every file and directory (with a trailing /) of a real two-step run, relative to its run directory."""
    from flows.train import run_training
    from trace_rl.runs.loading import validate_config

    evaluation = {"k": 1, "num_examples": 1, "envs": [{"id": "reverse-text"}]}  # writes eval/step_000002/
    config = validate_config(small_config(str(tmp_path_factory.mktemp("runs")), "documented", eval=evaluation))
    run_training(config)
    root = Path(config.storage) / config.name
    return [str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*")]


def test_the_paths_the_docs_name_are_the_paths_a_run_writes(run_files):
    documented = documented_paths()
    # the README shows the zero-padded form the steps have, not just a placeholder (issue 19)
    assert any(re.fullmatch(r"steps/\d{6}/metrics\.json", path) for path, docs in documented.items()
               if "README.md" in docs)
    missing = {path: sorted(docs) for path, docs in documented.items()
               if path not in ONLY_SOME_RUNS and not any(pattern(path).fullmatch(f) for f in run_files)}
    assert missing == {}, f"documented but not written by a run: {missing}\nthe run wrote: {sorted(run_files)}"
