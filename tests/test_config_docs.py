import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_lists_every_key_as_the_models_define_them():
    check = subprocess.run([sys.executable, "scripts/config_docs.py", "--check"], cwd=ROOT)
    assert check.returncode == 0, "docs/config.md is stale: run `python scripts/config_docs.py`"
