"""`python -I -S forward.py SOCKETS PORT[,PORT...] -- PROGRAM...`: inside a sandbox without the host's network,
serve each host loopback PORT on the sandbox's own 127.0.0.1:PORT, relayed through the unix socket SOCKETS/PORT
that the host side (`Sandbox.allow`) holds, then run PROGRAM (exec: it stays the process the sandbox waits
for). The relay runs in a child process, listening before PROGRAM starts, and dies with the sandbox's pid
namespace when PROGRAM ends. Standard library, sockets and threads only: it starts before every program.
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


def serve(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.connect(path)
        except OSError:
            client.close()
            continue
        for source, target in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(source, target), daemon=True).start()


def main() -> None:
    sockets, ports, separator, *program = sys.argv[1:]
    if separator != "--" or not program:
        sys.exit("usage: forward.py SOCKETS PORT[,PORT...] -- PROGRAM...")
    listeners = []
    try:
        for port in ports.split(","):
            listener = socket.socket()
            listener.bind(("127.0.0.1", int(port)))
            listener.listen(64)
            listeners.append((listener, os.path.join(sockets, port)))
    except OSError as exc:
        sys.exit(f"sandbox: the relay of the allowed endpoints did not start: {exc}")
    if os.fork() == 0:
        threads = [threading.Thread(target=serve, args=pair, daemon=True) for pair in listeners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        os._exit(0)
    for listener, _ in listeners:
        listener.close()
    os.execvp(program[0], program)


if __name__ == "__main__":
    main()
