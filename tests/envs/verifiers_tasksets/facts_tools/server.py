"""The MCP tool server of `facts_tools`, run by verifiers as `python -m facts_tools.server`."""

import asyncio
import os
import socket

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
    def reach(self, port: int) -> str:
        """Whether the server connects to 127.0.0.1:`port`."""
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except OSError as exc:
            return f"no: {type(exc).__name__}"
        return "yes"

    @vf.tool
    async def wait(self, seconds: float) -> str:
        """Answers after `seconds`."""
        await asyncio.sleep(seconds)
        return "waited"


if __name__ == "__main__":
    FactsToolset.run()
