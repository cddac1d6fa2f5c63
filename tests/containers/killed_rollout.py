"""Plays one code_tasks rollout in podman whose program sleeps, and prints `started` once its container runs
(tests/containers/test_podman.py SIGKILLs this process then)."""

import subprocess
import sys
import threading
import time

from transformers import AutoTokenizer

from tests.containers.test_podman import code_env, play
from tests.envs.conftest import ScriptedRuntime


def announce() -> None:
    while not subprocess.run(["podman", "ps", "--filter", "label=verifiers.run", "-q"], capture_output=True,
                             text=True).stdout.strip():
        time.sleep(0.2)
    print("started", flush=True)


threading.Thread(target=announce, daemon=True).start()
runtime = ScriptedRuntime(AutoTokenizer.from_pretrained(sys.argv[1]), ["```python\nimport time; time.sleep(600)\n```"])
play(code_env(), runtime, task=0)
