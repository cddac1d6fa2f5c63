"""Session-wide fixtures: shared servers and models, started once per test session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory):
    """Keep caches and Prefect state of the test session out of the user's home."""
    home = tmp_path_factory.mktemp("trace-rl-home")
    os.environ.setdefault("TRACE_RL_CACHE", str(home / "cache"))
    os.environ["TRACE_RL_HOME"] = str(home)
    os.environ["DO_NOT_TRACK"] = "1"
    yield


@pytest.fixture(scope="session", autouse=True)
def _reaper():
    """The test session's reaper (trace_rl.machine.reaper): the servers and runs the tests start, each in a process
    group of its own (`process_group=0`, so that killpg stops it with what it started) but in pytest's session, die
    with pytest also where it ends without its teardown (SIGTERM, SIGKILL)."""
    from trace_rl.machine import reaper

    reaper.start()


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on loopback, with a bucket `trace-rl-test`."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, 30, proc)
        endpoint = f"http://127.0.0.1:{port}"
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update(env)
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="trace-rl-test")
        yield {"endpoint_url": endpoint, "bucket": "trace-rl-test",
               "storage_options": {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}}
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """The session's one real Prefect server process, for every test that runs flows."""
    from flows import prefect_server

    os.environ["TRACE_RL_PREFECT_PORT"] = str(free_port())
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-client"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    record = prefect_server.start()
    os.environ["PREFECT_API_URL"] = record["api_url"]
    yield record["api_url"]
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=5)  # send the session's last logs while the server is still up
    prefect_server.stop()


def start_vllm_server(model_path: str, port: int, log, sockets: str) -> subprocess.Popen:
    """A real OpenAI-compatible vLLM server on 127.0.0.1:`port` with trace-rl's weight-reload extension and LoRA
    adapters of rank <= LORA_RANK loadable at run time, and the token-in/token-out `/inference/v1/generate` that
    verifiers env servers sample from (--enable-scale-out), in its own process group (killpg stops its engine too),
    its ZMQ sockets in the folder `sockets` (vLLM leaves them in the temp dir); returns once it listens."""
    from trace_rl.inference.vllm_worker import EXTENSION

    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
         "--enforce-eager", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
         "--kv-cache-memory-bytes", str(2**28), "--worker-extension-cls", EXTENSION,
         "--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", "1", "--enable-scale-out"],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
             "VLLM_RPC_BASE_PATH": sockets},
        stdout=log, stderr=subprocess.STDOUT, process_group=0,
    )
    wait_for_port(port, 300, proc)
    return proc


class VLLMServer:
    """The session's vLLM server process on the tiny model (`url`); a test that kills it `restart()`s it on the
    same address, and one that loads other weights into it loads the tiny model's own back."""

    def __init__(self, model_path: str, log_path):
        self.model_path, self.log_path, self.port = model_path, log_path, free_port()
        self.sockets = str(log_path.parent)
        self.url = f"http://127.0.0.1:{self.port}"
        self.restart()

    def restart(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = start_vllm_server(self.model_path, self.port, log, self.sockets)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(60)


@pytest.fixture(scope="session")
def sandbox_image():
    """The default image of verifiers' podman runtime (`trace-rl sandbox build`), built here once per recipe (the
    engine's store keeps it); skipped where podman is not installed."""
    import shutil

    if shutil.which("podman") is None:
        pytest.skip("podman is not installed here (apt-get install -y podman runc mmdebstrap, as .ci/run does)")
    from trace_rl.containers.engine import engine_problem
    from trace_rl.containers.image import build

    problem = engine_problem("podman")
    assert problem is None, problem
    return build()


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from trace_rl.models.tiny import build_tiny

    return str(build_tiny(0))


@pytest.fixture(scope="session")
def vllm_server(tiny_model_path, tmp_path_factory):
    """The session's one vLLM server process (`VLLMServer`), for every test that samples from a server."""
    server = VLLMServer(tiny_model_path, tmp_path_factory.mktemp("vllm-server") / "server.log")
    yield server
    server.stop()


# The session's vLLM engine. Its step budget equals max_model_len, the least vLLM on CPU allows, so a
# step with a few multi-turn rollouts already holds more prompt tokens than one engine step takes: the
# case that crashed seeded sampling when vLLM chunked prompts (issue 20).
VLLM_ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "cpu_kv_cache_gb": 0.25}
VLLM_OVERRIDES = ["inference.backend=vllm", *(f"inference.{key}={value}" for key, value in VLLM_ENGINE.items())]


@pytest.fixture(scope="session")
def vllm_runtime(tiny_model_path):
    """The session's one in-process vLLM engine on the tiny model (key `policy`), shared by every test
    (runs with `model.name = "tiny"` and VLLM_OVERRIDES reuse it).

    Tests that broadcast other weights into it load the tiny model's own weights back afterwards.
    """
    from trace_rl.inference.build import build_runtime
    from trace_rl.inference.vllm_engine import shutdown_engines
    from trace_rl.models.runtime import RuntimeConfig

    yield build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="vllm", **VLLM_ENGINE))
    shutdown_engines()


# The session's LoRA-enabled engine: enabling LoRA on the shared engine would change the engine every other test
# samples with, so LoRA gets its own. It serves adapters up to configs/lora.toml's rank, so that config's test and
# every run whose [model.lora] rank is 9 to 16 on the tiny model reuse it (vLLM's next rank below 16 is 8).
LORA_RANK = 16


@pytest.fixture(scope="session")
def vllm_lora_runtime(vllm_runtime, tiny_model_path):
    """The session's in-process vLLM engine with LoRA enabled (key `policy`, the tiny model); stopped with the
    shared one. Tests load the tiny model's own weights back (which drops the adapter) when done."""
    from trace_rl.config import LoraConfig
    from trace_rl.inference.build import build_runtime
    from trace_rl.models.runtime import RuntimeConfig

    return build_runtime(RuntimeConfig(key="policy", name=tiny_model_path, backend="vllm",
                                       lora=LoraConfig(rank=LORA_RANK), **VLLM_ENGINE))


@pytest.fixture
def shared_vllm(vllm_runtime, tiny_model_path):
    """The session's engine for a test that trains through it (a run broadcasts its weights into it): the
    tiny model's own weights are loaded back afterwards, as the tests that sample it directly expect."""
    import asyncio

    yield vllm_runtime
    asyncio.run(vllm_runtime.load_weights(tiny_model_path, 0))
    vllm_runtime.policy_step = 0


@pytest.fixture(scope="session")
def uninterrupted_run(prefect_api, tmp_path_factory):
    """The storage (`RunStorage`) of `tests.flows.conftest.small_config`'s 3-step run that nothing interrupts,
    trained in this process once: the run a crash or fault test of that config (any name, any storage) ends bitwise
    equal to."""
    import tomli_w

    from tests.flows.conftest import small_config
    from tests.flows.test_crash_resume import train_here
    from trace_rl.storage import RunStorage

    directory = tmp_path_factory.mktemp("uninterrupted")
    config = directory / "uninterrupted.toml"
    config.write_text(tomli_w.dumps(small_config(str(directory / "runs"), "uninterrupted", steps=3)))
    train_here(config)
    return RunStorage(str(directory / "runs"), "uninterrupted")


@pytest.fixture(scope="session")
def uninterrupted(uninterrupted_run) -> bytes:
    """The final weights (model.safetensors of step 3) of `uninterrupted_run`."""
    from tests.bitwise import weights_bytes

    return weights_bytes(uninterrupted_run, 3)


@pytest.fixture(scope="session")
def realistic_model():
    """The realistic fixture model (`trace_rl.models.realistic`), built once into a Hugging Face hub cache under the
    session's cache, with HF_HUB_CACHE pointing there and HF_HUB_OFFLINE=1 for the rest of the session, so
    `model.name = "trace-rl/qwen2-fixture"` resolves by hub id exactly as a downloaded model does.

    Gives `repo_id`, `path` (its snapshot directory), `commit` and `cache` (the hub cache root).
    """
    from pathlib import Path
    from types import SimpleNamespace

    from trace_rl.models.realistic import REPO_ID, build_realistic_model

    cache = Path(os.environ["TRACE_RL_CACHE"]) / "hf-hub"
    path = build_realistic_model(cache)
    saved = {key: os.environ.get(key) for key in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    os.environ.update({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    yield SimpleNamespace(repo_id=REPO_ID, path=str(path), commit=path.name, cache=cache)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    """After `--durations`' slowest tests: the suite's time by test directory (setup, call and teardown), so a new
    slow test shows where it landed (README, Tests)."""
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                folder = os.path.dirname(report.nodeid.split("::")[0]) or "."
                seconds[folder] = seconds.get(folder, 0.0) + report.duration
    if len(seconds) > 1:
        terminalreporter.write_sep("=", "time by test directory")
        for folder, total in sorted(seconds.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{total:8.1f}s  {folder}")
