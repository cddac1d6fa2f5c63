import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_lists_every_key_as_the_models_define_them():
    check = subprocess.run([sys.executable, "scripts/config_docs.py", "--check"], cwd=ROOT)
    assert check.returncode == 0, "docs/config.md is stale: run `python scripts/config_docs.py`"


def test_docs_config_types_read_as_a_user_writes_them():
    text = (ROOT / "docs" / "config.md").read_text()
    assert "| `algorithms` | `list[AlgorithmConfig]` |" in text
    for internal in ("Annotated[", "BeforeValidator", "Optional[", "<class"):
        assert internal not in text
