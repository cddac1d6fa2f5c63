"""`python -m trace_rl.sandbox.forward SOCKETS PORT[,PORT...] -- PROGRAM...`: inside a sandbox without the
host's network, serve each host loopback PORT on the sandbox's own 127.0.0.1:PORT, relayed through the unix
socket SOCKETS/PORT that the host side (`Sandbox.forward`) holds, then run PROGRAM (exec: it stays the process
the sandbox waits for). The relay runs in a child process, ready before PROGRAM starts, and dies with the
sandbox's pid namespace when PROGRAM ends. Standard library only: it starts for every program.
"""

from __future__ import annotations

import asyncio
import os
import sys

CHUNK = 64 * 1024


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def relay(sockets: str, ports: list[int], ready: int) -> None:
    async def serve(port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_unix_connection(os.path.join(sockets, str(port)))
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    servers = [await asyncio.start_server(lambda r, w, port=port: serve(port, r, w), "127.0.0.1", port)
               for port in ports]
    os.write(ready, b"ready")
    os.close(ready)
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main() -> None:
    sockets, ports, separator, *program = sys.argv[1:]
    if separator != "--" or not program:
        sys.exit("usage: python -m trace_rl.sandbox.forward SOCKETS PORT[,PORT...] -- PROGRAM...")
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        asyncio.run(relay(sockets, [int(port) for port in ports.split(",")], write))
        os._exit(0)
    os.close(write)
    if os.read(read, 5) != b"ready":
        sys.exit("sandbox: the relay of the allowed endpoints did not start")
    os.close(read)
    os.execvp(program[0], program)


if __name__ == "__main__":
    main()
