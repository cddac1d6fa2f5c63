"""Every shipped config validates, and the table in the README lists each one."""

from pathlib import Path

import pytest

from trace_rl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_is_valid(path):
    config = load_config(path)
    assert config.name == path.stem or path.stem == "demo"


def test_readme_lists_every_config():
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in CONFIGS if f"configs/{p.name}" not in readme] == []


def test_the_demo_is_grpo_on_reverse_text():
    config = load_config(ROOT / "configs" / "demo.toml")
    assert [a.id for a in config.algorithms] == ["grpo"] and config.env[0].id == "reverse-text"
