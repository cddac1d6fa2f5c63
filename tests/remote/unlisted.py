"""A module no test server allows: importing it leaves a marker file, so a test can tell it was never imported."""

import os
from pathlib import Path

from trace_rl.algorithms.base import Algorithm

Path(os.environ["TRACE_RL_TEST_IMPORT_MARKER"]).write_text("imported")


class Unlisted(Algorithm):
    loss = "rl"

    async def advantage(self, traces):
        pass
