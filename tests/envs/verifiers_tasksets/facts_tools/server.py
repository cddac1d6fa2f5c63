"""The MCP tool server of `facts_tools`, run by verifiers as `python -m facts_tools.server`."""

import asyncio
import os

import verifiers.v1 as vf

FACTS = {"oak": "a tree with acorns", "tin": "element fifty"}
EVERYTHING = "everything " * 300  # what `lookup("everything")` answers: longer than the tests' context


class FactsToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "facts"

    @vf.tool
    def lookup(self, key: str) -> str:
        """What a word means."""
        return FACTS.get(key) or (EVERYTHING if key == "everything" else "no entry")

    @vf.tool
    def crash(self) -> str:
        """Ends the server's process."""
        os._exit(3)

    @vf.tool
    async def wait(self, seconds: float) -> str:
        """Answers after `seconds`."""
        await asyncio.sleep(seconds)
        return "waited"


if __name__ == "__main__":
    FactsToolset.run()
