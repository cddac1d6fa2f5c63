"""Hostile programs, each run as a rollout runs one (verifiers' `runtime.run` on the sandbox runtime): the host is
unchanged, the program ends with a result the rollout reads (an exit code, a note of the limit that killed it),
and nothing of it is left running."""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from trace_rl.sandbox import KILLED, SandboxConfig, bwrap_lack
from trace_rl.sandbox.bwrap import PASSED

pytestmark = pytest.mark.skipif(bwrap_lack() is not None, reason=f"the sandbox needs {bwrap_lack()}")

LIMITS = SandboxConfig(wall_time_s=4, output_bytes=1 << 20, file_size_mb=16, disk_mb=48)


def processes_of(runtime) -> list[str]:
    """The host's processes of this sandbox: its bwraps (their command names its folder) and its uid's."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            uid = int(next(line for line in (entry / "status").read_text().splitlines()
                           if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if str(runtime.sandbox.folder) in cmdline or (runtime.sandbox.uid is not None and uid == runtime.sandbox.uid):
            found.append(f"{entry.name} {cmdline}")
    return found


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def runtime(loop):
    """One sandbox runtime for every hostile program, as a rollout's."""
    from trace_rl.sandbox.runtime import BwrapConfig, BwrapRuntime

    runtime = BwrapRuntime(BwrapConfig.of(LIMITS), name="hostile")
    loop.run_until_complete(runtime.start())
    yield runtime
    loop.run_until_complete(runtime.stop())
    assert not runtime.sandbox.folder.exists()


@pytest.fixture
def run(runtime, loop):
    """`run(program)` runs a Python program as the rollout's `python3 solution.py`, then checks that nothing of it
    is left running."""

    def run_program(program: str, timeout_s: float = 20):
        for folder in (runtime.sandbox.workdir, runtime.sandbox.tmp):  # what the program before it left
            for path in folder.iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        loop.run_until_complete(runtime.write("solution.py", program.encode()))
        started = time.monotonic()
        result = loop.run_until_complete(asyncio.wait_for(runtime.run(["python3", "solution.py"], {}), timeout_s))
        run_program.seconds = time.monotonic() - started
        assert processes_of(runtime) == []
        return result

    return run_program


def test_writing_outside_its_folder_fails_and_the_host_is_unchanged(run, runtime, tmp_path):
    home = Path.home()
    probe = f"trace-rl-probe-{os.getpid()}"
    sentinels = [Path(place, f"{probe}-sentinel") for place in (home, "/tmp", tmp_path)]
    for sentinel in sentinels:
        sentinel.write_text("host")
    result = run(f"""
import os, shutil
for path in ["/{probe}", "/tmp/{probe}", "{home}/{probe}", "{tmp_path}/{probe}", "/usr/{probe}"]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as exc:
        print("refused", path, type(exc).__name__)
open(os.path.expanduser("~/mine"), "w").write("x")  # its own home is its working folder
shutil.rmtree(os.path.expanduser("~"), ignore_errors=True)  # rm -rf ~
os.system("rm -rf {home} /etc /usr/bin/env /tmp/* 2>/dev/null")
print("home is", os.path.expanduser("~"))
""")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("refused") == 4 and f"wrote /tmp/{probe}" in result.stdout  # its own /tmp
    assert f"home is {runtime.sandbox.workdir}" in result.stdout
    assert all(sentinel.read_text() == "host" for sentinel in sentinels)
    for sentinel in sentinels:
        sentinel.unlink()
    assert not any(Path(place, probe).exists() for place in ["/", "/tmp", home, tmp_path, "/usr"])
    assert Path("/usr/bin/env").exists() and Path("/etc/passwd").exists()


def test_the_trainers_environment_and_other_processes_environ_are_not_readable(run, monkeypatch):
    monkeypatch.setenv("TRACE_RL_FAKE_S3_SECRET", "s3cr3t-value")  # set in the parent, as the trainer holds one
    result = run("""
import glob, os
print(sorted(os.environ))
for path in glob.glob("/proc/*/environ"):
    try:
        print(path, open(path, "rb").read())
    except OSError as exc:
        print(path, type(exc).__name__)
print(os.listdir("/proc/1"), os.path.exists("/root/.trace-rl"))
""")
    assert result.exit_code == 0, result.stderr
    assert "s3cr3t-value" not in result.stdout and "TRACE_RL_FAKE_S3_SECRET" not in result.stdout
    names = set(ast.literal_eval(result.stdout.splitlines()[0]))
    assert names <= {"HOME", "LANG", "PATH", "PWD", "PYTHONPATH", "TMPDIR", *PASSED}
    assert result.stdout.rstrip().endswith("False")


def test_connecting_to_the_prefect_api_and_the_s3_endpoint_fails(run):
    servers, accepted = [], []
    for _ in range(2):  # one stands for the Prefect API (127.0.0.1:4200), one for the S3 endpoint
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        servers.append(server)

    stop = threading.Event()

    def accept(server):
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    threads = [threading.Thread(target=accept, args=(server,), daemon=True) for server in servers]
    for thread in threads:
        thread.start()
    ports = [server.getsockname()[1] for server in servers]
    try:
        result = run(f"""
import socket
for port in {ports}:
    for host in ["127.0.0.1", "localhost", "{socket.gethostname()}"]:
        try:
            socket.create_connection((host, port), timeout=1).close()
            print("connected", host, port)
        except OSError as exc:
            print("refused", host, port, type(exc).__name__)
""")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for server in servers:
            server.close()
    assert result.exit_code == 0, result.stderr
    assert "connected" not in result.stdout and result.stdout.count("refused") == 6
    assert accepted == []


def test_a_fork_storm_stops_at_the_process_limit_and_is_killed(run):
    result = run("""
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError as exc:
    print("forks refused after", children, type(exc).__name__, flush=True)
while True:
    try:
        os.fork() or time.sleep(60)
    except OSError:
        pass
""")
    assert result.exit_code == KILLED and "wall time over 4 s" in result.stderr
    refused_after = int(result.stdout.split()[3])
    assert 900 <= refused_after < LIMITS.max_processes  # the limit counts the sandbox's processes only
    assert os.fork() or os._exit(0)  # the host still forks


def test_an_infinite_loop_is_killed_at_the_wall_time(run):
    result = run("while True: pass")
    assert result.exit_code == KILLED and result.stderr.endswith("sandbox: program killed: wall time over 4 s\n")
    assert 4 <= run.seconds < 8


def test_300_mb_on_stdout_is_cut_at_the_output_limit(run):
    result = run("import sys\nfor _ in range(300):\n    sys.stdout.write('x' * (1 << 20))")
    assert result.exit_code == KILLED and "output over 1048576 bytes" in result.stderr
    assert len(result.stdout) + len(result.stderr) <= (1 << 20) + 100
    assert run.seconds < 3  # killed at the limit, not at the wall time


def test_filling_the_disk_is_stopped_by_the_file_and_folder_limits(run, runtime):
    big = run("open('big', 'wb').write(b'x' * (64 << 20))")  # Python ignores SIGXFSZ: the write fails instead
    assert big.exit_code == 1 and "OSError: [Errno 27] File too large" in big.stderr
    assert (runtime.sandbox.workdir / "big").stat().st_size <= LIMITS.file_size_mb << 20
    many = run("""
import os, time
os.makedirs('fill', exist_ok=True)
for i in range(100):
    open(f'fill/{i}', 'wb').write(os.urandom(8 << 20))
    time.sleep(0.02)
""")
    assert many.exit_code == KILLED and "disk over 48 MiB" in many.stderr
    held = sum(f.stat().st_size for f in runtime.sandbox.folder.rglob("*") if f.is_file())
    assert held < 96 << 20


def test_a_daemon_left_behind_dies_with_its_program(run):
    result = run("""
import subprocess, sys
subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=sys.stdout)
subprocess.Popen(["sh", "-c", "nohup sleep 600 >/dev/null 2>&1 &"])
print("left two daemons")
""")
    assert result.exit_code == 0 and result.stdout == "left two daemons\n"
    assert run.seconds < 2  # the daemon does not hold the rollout (it still had stdout open)
