"""README.md's tour, run in order as a new user would type it, scaled down: every `trace-rl` command of its code
blocks runs as written (in a copy of `configs/`, whose runs are made small and use the hf sampler) and succeeds.
A command the README adds or changes is run here too, so the tour cannot drift from what works."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

ROOT = Path(__file__).resolve().parents[2]
# what the tour's `train` commands run, made small: as many steps as the tour's `replay --steps` needs, and a run's
# last step stands for the original's (`export runs/lora --step 60` exports the scaled run's last step)
STEPS = {"demo": 7, "gsm8k-style": 5, "lora": 3}
NOT_RUN = ("serve", "hf download")  # serve runs until stopped; a Hub download needs the network


def tour_commands() -> list[str]:
    """The `trace-rl` commands of the README's "A tour" section, continuation lines joined, comments dropped."""
    tour = (ROOT / "README.md").read_text().split("## A tour", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", tour, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(".venv/bin/trace-rl") and not any(word in line for word in NOT_RUN):
                commands.append(line)
    return commands


def scaled_configs(directory: Path) -> dict[str, int]:
    """Copy `configs/` into `directory`, each run small (2 x 2 rollouts of 6 tokens on the hf sampler); returns
    each config's original step count."""
    shutil.copytree(ROOT / "configs", directory / "configs")
    original = {}
    for path in (directory / "configs").glob("*.toml"):
        data = tomllib.loads(path.read_text())
        original[data["name"]] = data["steps"]
        data["steps"] = STEPS.get(data["name"], data["steps"])
        data.setdefault("inference", {})["backend"] = "hf"
        data.setdefault("sampling", {})["max_completion_tokens"] = 6
        for env in data["env"]:
            env["batch_size"], env["group_size"] = 2, 2
        if "eval" in data:
            data["eval"].update(num_examples=2, k=2, sampling={"max_completion_tokens": 6})
        path.write_text(tomli_w.dumps(data))
    return original


def scaled(command: str, original_steps: dict[str, int]) -> list[list[str]]:
    """The command's argv (once per variant: `[--train]` runs without, then with it into a fresh --out), with a
    run's last step (`--step 60` of the 60-step lora run) moved to the scaled run's last step."""
    words = shlex.split(command)[1:]
    if words[0] in ("eval", "export") and "--step" in words:
        run = Path(words[1]).name
        at = words.index("--step") + 1
        if int(words[at]) == original_steps[run]:
            words[at] = str(STEPS[run])
    if "[--train]" not in words:
        return [words]
    plain = [w for w in words if w != "[--train]"]
    out = plain.index("--out") + 1
    with_train = [*plain, "--train"]
    with_train[out] += "-trained"
    return [plain, with_train]


@pytest.mark.slow
def test_the_readme_tour_runs_in_order_as_written(prefect_api, tmp_path):
    original_steps = scaled_configs(tmp_path)
    commands = tour_commands()
    assert len(commands) >= 10, commands  # train, dry-run, resume, replay, eval, lora and export at least
    for command in commands:
        for argv in scaled(command, original_steps):
            result = subprocess.run([sys.executable, "-m", "flows.cli", *argv], cwd=tmp_path, capture_output=True,
                                    text=True, timeout=600, check=False)
            assert result.returncode == 0, (argv, result.stderr[-3000:])
            assert "Traceback" not in result.stderr, (argv, result.stderr[-3000:])
    assert (tmp_path / "out" / "merged" / "config.json").exists()
    assert (tmp_path / "runs" / "demo-replay-trained" / "weights" / "000007" / "STABLE").exists()
