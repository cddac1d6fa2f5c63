"""moto's S3 server, restored from its request journal before it listens: `python -m tests.faults.moto_restored
JOURNAL PORT [DIE_AT]`. With DIE_AT it SIGKILLs itself when a request 'METHOD /path' starting with it arrives,
before handling (or journaling) it: a crash at an exact point of a client's writes, whatever the timing.
The journal is replayed in-process, so no client request can interleave with the replay, and requests are
journaled one at a time: moto's recorder writes an entry and its newline in two appends, so two
server threads could otherwise put two entries on one line."""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import threading
from urllib.parse import urlsplit

from moto.moto_api import recorder
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple
from werkzeug.test import Client


def dying_at(app, prefix: str):
    def handle(environ, start_response):
        if f"{environ['REQUEST_METHOD']} {environ.get('PATH_INFO', '')}".startswith(prefix):
            os.kill(os.getpid(), signal.SIGKILL)
        return app(environ, start_response)

    return handle


def main(journal: str, port: int, die_at: str | None = None) -> None:
    app = DomainDispatcherApplication(create_backend_app)
    client = Client(app)
    recorder.stop_recording()  # the replay is already in the journal
    with open(journal) as entries:
        for line in entries:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break  # the last line, half-written when the server was killed
            body = base64.b64decode(entry["body"]) if entry.get("body_encoded") else (entry.get("body") or b"")
            url = urlsplit(entry["url"])
            headers = {k: v for k, v in entry["headers"].items() if k.lower() != "transfer-encoding"}
            client.open(url.path, method=entry["method"], query_string=url.query, headers=headers, data=body)
    record, one_at_a_time = recorder._record_request, threading.Lock()

    def record_whole_line(*args, **kwargs):
        with one_at_a_time:
            record(*args, **kwargs)

    recorder._record_request = record_whole_line
    recorder.start_recording()
    run_simple("127.0.0.1", port, dying_at(app, die_at) if die_at else app, threaded=True, use_reloader=False)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
