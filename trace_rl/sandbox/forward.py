"""`python -I -S forward.py RELAY PORT[,PORT...] SERVED[,SERVED...] -- PROGRAM...`: inside a sandbox without the
host's network, serve each host loopback PORT on the sandbox's own 127.0.0.1:PORT, relayed through the unix socket
RELAY/sockets/PORT that the host side (`Sandbox.allow`) holds; and take the connections to each SERVED port of the
sandbox (a tool server PROGRAM listens there) from the unix socket RELAY/served/SERVED, which the host side
(`Sandbox.expose`) connects to. Then run PROGRAM (exec: it stays the process the sandbox waits for). The relay
runs in a child process, listening before PROGRAM starts, and dies with the sandbox's pid namespace when PROGRAM
ends. Standard library, sockets and threads only: it starts before every program.
"""

import os
import socket
import sys
import threading

CHUNK = 64 * 1024


def pipe(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(CHUNK):
            target.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, target):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listener: socket.socket, family: int, address) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(family)
        try:
            upstream.connect(address)
        except OSError:
            upstream.close()
            client.close()
            continue
        for source, target in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(source, target), daemon=True).start()


def ports(text: str) -> list[int]:
    return [int(port) for port in text.split(",") if port]


def main() -> None:
    relay, routes, served, separator, *program = sys.argv[1:]
    if separator != "--" or not program:
        sys.exit("usage: forward.py RELAY PORT[,PORT...] SERVED[,SERVED...] -- PROGRAM...")
    listeners = []
    try:
        for port in ports(routes):
            listener = socket.socket()
            listener.bind(("127.0.0.1", port))
            listener.listen(64)
            listeners.append((listener, socket.AF_UNIX, os.path.join(relay, "sockets", str(port))))
        for port in ports(served):
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(os.path.join(relay, "served", str(port)))
            listener.listen(64)
            listeners.append((listener, socket.AF_INET, ("127.0.0.1", port)))
    except OSError as exc:
        sys.exit(f"sandbox: the relay of the allowed endpoints did not start: {exc}")
    if os.fork() == 0:
        threads = [threading.Thread(target=serve, args=entry, daemon=True) for entry in listeners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        os._exit(0)
    for listener, _, _ in listeners:
        listener.close()
    os.execvp(program[0], program)


if __name__ == "__main__":
    main()
