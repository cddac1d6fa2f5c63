"""The default image of verifiers' container runtimes, built here: no container registry is needed (none may be
reachable), and a sandbox needs no network at run time.

`mmdebstrap` builds a minimal Debian root from Debian's packages (Python, iptables and iproute2 for verifiers'
network cut). The PyPI wheels of what verifiers' harnesses install with `uv sync --script` (the `bash` harness's
chat program, `mini_swe_agent`'s mini-swe-agent) and `uv` itself are baked in, with a PEP 503 index of them that the
image's `UV_DEFAULT_INDEX` names, so a harness installs offline; both programs are installed already. The engine
imports the root as `localhost/trace-rl-sandbox:<recipe hash>`, also tagged as verifiers' network-cut helper image
(which verifiers would otherwise build from a registry's alpine). The root's tar is kept as
`$TRACE_RL_CACHE/images/<hash>.tar`, so a wiped engine store re-imports it without rebuilding.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from trace_rl.errors import RefusedError

IMAGE_NAME = "localhost/trace-rl-sandbox"
NETWORK_IMAGE = "localhost/verifiers-network:1"  # verifiers.v1.runtimes.docker._NETWORK_IMAGE
SUITE = "bookworm"
PACKAGES = ("python3", "iptables", "iproute2", "ca-certificates", "procps")
WHEELS_DIR = "/opt/trace-rl/wheels"
INDEX_DIR = "/opt/trace-rl/simple"  # a PEP 503 index of the wheels: uv's `--no-index` has no environment variable
IMAGE_ENV = {
    "UV_DEFAULT_INDEX": f"file://{INDEX_DIR}", "UV_PYTHON_DOWNLOADS": "never", "UV_PYTHON_PREFERENCE": "only-system",
    "UV_LINK_MODE": "copy",
}
CHANGES = [*(f"ENV {key}={value}" for key, value in IMAGE_ENV.items()), 'CMD ["/bin/sh"]']
# verifiers runs `sleep infinity` as a container's init, which ignores SIGTERM, and removes the container with
# `rm --force`: podman's stops it first and would wait out the 10 s stop timeout (blocking the event loop: verifiers'
# cleanup is synchronous) unless the stop signal is SIGKILL; docker's kills at once, and its import takes no STOPSIGNAL
ENGINE_CHANGES = {"podman": [*CHANGES, "STOPSIGNAL SIGKILL"], "docker": CHANGES}
INSTALL = {"podman": "apt-get install -y podman runc", "docker": "apt-get install -y docker.io"}
BUILD = {"podman": "trace-rl sandbox build", "docker": "trace-rl sandbox build --engine docker"}
RECIPE_VERSION = 2  # bump when the build below changes what it makes


class ImageError(RefusedError):
    """The image cannot be built or imported here; its message is one line naming the fix."""


def harness_programs() -> list[tuple[str, str]]:
    """The programs verifiers' harnesses install with uv (`Runtime.prepare_uv_script`): the `bash` harness's chat
    program and `mini_swe_agent`'s (at its default pinned version), each as its path in a container runtime and
    its source."""
    from verifiers.v1.harnesses.mini_swe_agent.harness import PROGRAM_SOURCE, MiniSWEAgentHarnessConfig
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.base import Runtime

    sources = [CHAT_PROGRAM_SOURCE, PROGRAM_SOURCE.replace("{version}", MiniSWEAgentHarnessConfig().version)]
    return [(f"{Runtime.scripts_dir}/{hashlib.sha256(source.encode()).hexdigest()}.py", source)
            for source in sources]


# what the programs need on the image's Python that pip, evaluating markers on the Python it runs on, leaves out:
# redis (litellm[proxy] -> rq) wants it before Python 3.11.3, and Debian 12's is 3.11.2
IMAGE_PYTHON_EXTRAS = ["async-timeout>=4.0.3"]


def harness_requirements() -> list[list[str]]:
    """uv (which installs the harnesses' programs), then the PEP 723 dependencies of each program, each resolved
    on its own as uv resolves it, then IMAGE_PYTHON_EXTRAS."""
    headers = [re.search(r"^# dependencies = (\[.*\])$", source, re.MULTILINE) for _, source in harness_programs()]
    return [["uv"], *(json.loads(header.group(1)) for header in headers), IMAGE_PYTHON_EXTRAS]


def recipe() -> dict:
    from importlib.metadata import version

    return {"version": RECIPE_VERSION, "suite": SUITE, "packages": list(PACKAGES),
            "requirements": harness_requirements(), "python": "3.11", "changes": ENGINE_CHANGES["podman"],
            "verifiers": version("verifiers")}


def default_tag() -> str:
    digest = hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{IMAGE_NAME}:{digest}"


def cache_dir() -> Path:
    return Path(os.environ.get("TRACE_RL_CACHE", Path.home() / ".cache" / "trace-rl")) / "images"


def image_exists(tag: str, engine: str = "podman") -> bool:
    return subprocess.run([engine, "image", "exists" if engine == "podman" else "inspect", tag],
                          capture_output=True).returncode == 0


def run(argv: list[str], what: str, fix: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or [f"exit {result.returncode}"]
        raise ImageError(f"{what} failed: {detail[0]}; {fix}")


def stage(folder: Path) -> None:
    """`folder` as the files laid over the Debian root: the harness wheels, and uv's binary out of its wheel."""
    wheels = folder / WHEELS_DIR.lstrip("/")
    wheels.mkdir(parents=True)
    for requirements in harness_requirements():
        run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.11",
             "--implementation", "cp", "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
             "--platform", "manylinux_2_28_x86_64", "-d", str(wheels), *requirements],
            "downloading the harness wheels from PyPI", "check that pip reaches a package index")
    projects: dict[str, list[str]] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        projects.setdefault(re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower(), []).append(wheel.name)
    for project, names in projects.items():
        page = folder / INDEX_DIR.lstrip("/") / project / "index.html"
        page.parent.mkdir(parents=True)
        page.write_text("".join(f'<a href="file://{WHEELS_DIR}/{name}">{name}</a>\n' for name in names))
    (uv_wheel,) = wheels.glob("uv-*.whl")
    binary = folder / "usr/local/bin/uv"
    binary.parent.mkdir(parents=True)
    with zipfile.ZipFile(uv_wheel) as archive:
        (member,) = [name for name in archive.namelist() if name.endswith(".data/scripts/uv")]
        binary.write_bytes(archive.read(member))
    binary.chmod(0o755)
    for path, source in harness_programs():
        (folder / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (folder / path.lstrip("/")).write_text(source)


def build_root(tar: Path, log: Callable[[str], None]) -> None:
    if shutil.which("mmdebstrap") is None:
        raise ImageError("building the sandbox image needs mmdebstrap: apt-get install -y mmdebstrap")
    with tempfile.TemporaryDirectory(prefix="trace-rl-image-") as work:
        staging = Path(work) / "staging"
        log("downloading the harness wheels")
        stage(staging)
        log(f"building a Debian {SUITE} root with {', '.join(PACKAGES)} (about a minute)")
        partial = tar.with_suffix(".partial")
        # the harnesses' programs installed where verifiers looks for them (uv keys a script's environment by its
        # path), so their rollouts start without installing them
        prewarm = " && ".join(f"chroot \"$1\" env HOME=/root {' '.join(f'{k}={v}' for k, v in IMAGE_ENV.items())} "
                              f"uv sync --script {path} -q --no-config" for path, _ in harness_programs())
        run(["mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", f"--include={','.join(PACKAGES)}",
             f"--customize-hook=cp -a {staging}/. \"$1\"/", f"--customize-hook={prewarm}",
             "--customize-hook=rm -rf \"$1\"/var/cache/apt/* \"$1\"/var/lib/apt/lists/*", SUITE, str(partial)],
            "mmdebstrap", "check that apt reaches Debian's mirror")
        partial.rename(tar)


def build(tag: str | None = None, engine: str = "podman", force: bool = False,
          log: Callable[[str], None] = lambda line: None) -> str:
    """The default image under `tag` (the recipe's) in `engine`'s store: kept if it is there, imported from the
    cached root if that is, built otherwise. Returns the tag."""
    if shutil.which(engine) is None:
        raise ImageError(f"`{engine}` is not installed: {INSTALL[engine]} (docs/containers.md)")
    tag = tag or default_tag()
    if not force and image_exists(tag, engine):
        log(f"{tag} is there")
        return tag
    tar = cache_dir() / f"{tag.rpartition(':')[2]}.tar"
    if force or not tar.exists():
        tar.parent.mkdir(parents=True, exist_ok=True)
        build_root(tar, log)
    log(f"importing {tar} as {tag}")
    run([engine, "import", *(arg for change in ENGINE_CHANGES[engine] for arg in ("--change", change)), str(tar), tag],
        f"{engine} import", f"see `{engine} import --help`")
    run([engine, "tag", tag, NETWORK_IMAGE], f"{engine} tag", f"see `{engine} tag --help`")
    return tag
