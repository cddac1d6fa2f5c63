"""`verifiers`: a verifiers v1 environment (a taskset, its agents, its own `vf.Env` if it has one) played through
the run's own sampler (docs/envs.md#verifiers).

`[env.args]` is a verifiers `EnvConfig` as verifiers' own TOML takes it (`taskset = { id = "my_tasks" }`, an
`id` pairing an env, the agents' seats), validated by verifiers (`vf.resolve_env_config`). An agent seat that
names no harness, of a taskset that bundles none, plays on trace-rl's in-process chat harness
(`trace_rl.verifiers.harness`) in trace-rl's sandbox (`trace_rl.sandbox`: the programs its task runs run there,
off the host); a seat that names one runs as verifiers runs it, in its runtime. A seat's `runtime = { type =
"bwrap", ... }` is the sandbox with its keys, `{ type = "subprocess" }` the host (one warning per process). Every turn the policy takes is sampled by the rollout's `Sampler`
(`trace_rl.verifiers.client`), so the run's [sampling], weights, LoRA adapter and broadcast apply as for any env.

`[[env]] select` picks the tasks with verifiers' own `SelectConfig` (`Taskset.select`, as `vf-eval --select.*`).
A bounded selection (a finite taskset, or an infinite one cut by closed `include.idx` ranges or a `limit`) is
walked epoch by epoch, in an order seeded by (run seed, env index, epoch). An unbounded one (an infinite taskset,
`INFINITE = True`, without such a bound) is a stream: step s takes the tasks at positions (s - 1) * batch_size ...
s * batch_size - 1 of it, so a resumed run takes the tasks it would have taken (the stream itself is the taskset's,
deterministic by its own seed). A rollout plays one episode of its task (`Env.run_slot`) and returns its traces
(`trace_rl.verifiers.convert`). An episode that failed is a failed rollout, with verifiers' error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import shutil
import sys
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from trace_rl.data.trace import Trace
from trace_rl.envs.base import EnvError, Environment, Example, Sampler, derive_seed, epoch_stream
from trace_rl.envs.registry import register_env
from trace_rl.errors import FatalError, RetryableError
from trace_rl.models.runtime import Generation

logger = logging.getLogger(__name__)
TYPE_BWRAP = "bwrap"  # a seat's sandbox runtime (trace_rl.sandbox), the default of trace-rl's chat harness
# `examples(seed, count)` of a stream (refill rounds): `count` tasks from position seed mod this
STREAM_DRAW_SPAN = 10_000
# what a runtime type needs on this machine: an executable on PATH, an account's key (a container engine's needs:
# trace_rl.containers.engine)
RUNTIME_NEEDS = {
    "apptainer": ("apptainer", None), "prime": (None, "PRIME_API_KEY"), "e2b": (None, "E2B_API_KEY"),
    "modal": (None, "MODAL_TOKEN_ID"),
}
CONTAINER_ENGINES = ("podman", "docker")  # their default image is trace-rl's, built here (trace_rl.containers)
# a rollout's container did not start: transient under many concurrent starts (podman's choice of a free host port
# for verifiers' published service port races), so the rollout is retried; a missing engine or image is refused
# before step 1
CONTAINER_NOT_STARTED = tuple(f"{engine} run failed" for engine in CONTAINER_ENGINES)


class VerifiersOptions(BaseModel):
    """`[env.args]`: a verifiers `EnvConfig`, checked by verifiers itself (`VerifiersEnv.check`)."""

    model_config = ConfigDict(extra="allow")


def verifiers_module():
    """`verifiers.v1` (the version trace-rl hooks into), or an EnvError naming the extra that installs it."""
    from trace_rl.verifiers.extra import VerifiersMissingError, require_verifiers

    try:
        require_verifiers("env 'verifiers'")
    except VerifiersMissingError as exc:
        raise EnvError(str(exc)) from None
    import verifiers.v1 as vf

    return vf


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def env_config(args: dict[str, Any], runtimes: bool = True):
    """The verifiers EnvConfig of `[env.args]`, with trace-rl's chat harness (and the subprocess runtime) for the
    seats that name no harness; an EnvError with verifiers' message when it refuses. `runtimes`: also check that
    this machine has every seat's runtime (it plays the episodes)."""
    vf = verifiers_module()
    from trace_rl.verifiers.harness import HARNESS_ID

    data = dict(args)
    tools_network = data.pop("tools_network", "routes")
    if tools_network not in ("routes", "host"):
        raise EnvError(f"env 'verifiers': args.tools_network = {tools_network!r}: set \"routes\" (the default: a "
                       "tool server reaches only its rollout's state channel) or \"host\" (docs/sandbox.md)")
    sandboxes = {}
    taskset = data.get("taskset")
    taskset_id = taskset.get("id") if isinstance(taskset, dict) else None
    if not taskset_id:
        raise EnvError("env 'verifiers': args.taskset.id is missing; name the taskset module, e.g. "
                       "args.taskset = { id = \"my_tasks\" }")
    try:
        config_type = vf.env_config_type(taskset_id, data.get("id") or "")
        bundled = vf.default_harness_id(taskset_id) != "bash"  # the taskset ships its own harness
        for name, field in config_type.model_fields.items():
            if not isinstance(field.default, vf.AgentConfig):
                continue
            seat = dict(data.get(name) or {})
            if "sampling" in seat:
                raise EnvError(f"env 'verifiers': args.{name}.sampling: the policy samples with the run's [sampling] "
                               "(or [env.sampling]); move the values there")
            if "harness" not in seat and field.default.harness is None and not bundled:
                seat["harness"] = {"id": HARNESS_ID}
            harness = seat.get("harness", field.default.harness)
            harness_id = harness.get("id") if isinstance(harness, dict) else getattr(harness, "id", None)
            sandbox = seat_sandbox(name, seat.get("runtime"), own_harness=harness_id == HARNESS_ID)
            if sandbox is not None:
                sandboxes[name] = sandbox
                seat["runtime"] = {"type": "subprocess"}  # verifiers checks the seat as the local runtime it is
            elif isinstance(seat.get("runtime"), dict) and seat["runtime"].get("type") == "subprocess":
                sandboxes[name] = None  # on the host, as it says
            runtime = seat.get("runtime")
            if isinstance(runtime, dict) and runtime.get("type") in CONTAINER_ENGINES:
                seat["runtime"] = container_runtime(runtime)
            data[name] = seat
        config = vf.resolve_env_config(data)
        sandboxed(config, sandboxes)
        if tools_network == "host":
            tools_on_host_network(config)
    except EnvError:
        raise
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise EnvError(f"env 'verifiers': args.{where}: {problem['msg']} (verifiers' EnvConfig)") from None
    except ModuleNotFoundError as exc:
        raise EnvError(f"env 'verifiers': args.taskset.id = {taskset_id!r}: {first_line(exc)} Put the folder that "
                       "holds it in the env's import_paths, or pip install it") from None
    except Exception as exc:  # noqa: BLE001 - a taskset or env module that fails to import, or refuses
        raise EnvError(f"env 'verifiers': args.taskset.id = {taskset_id!r}: {type(exc).__name__}: "
                       f"{first_line(exc)}") from None
    if runtimes:
        check_runtimes(config, HARNESS_ID)
    return config


def container_runtime(runtime: dict[str, Any]) -> dict[str, Any]:
    """A podman/docker seat's runtime with trace-rl's defaults: the image built here (`trace-rl sandbox build`, no
    registry), and no network but the rollout's own routes (the model endpoint, its tool servers) unless the seat
    sets verifiers' `allow` or `block` (docs/containers.md#network)."""
    from trace_rl.containers.image import default_tag

    defaults = {"image": default_tag()}
    if "allow" not in runtime and "block" not in runtime:
        defaults["allow"] = []
    return {**defaults, **runtime}


def seat_sandbox(name: str, runtime: Any, own_harness: bool):
    """The SandboxConfig of a seat's runtime: `{ type = "bwrap", ... }`, or none named on trace-rl's chat harness
    (which would otherwise run the task's programs on the host); None for another runtime (a named one, or
    verifiers' default for its own harnesses, which is no host). `{ type = "subprocess" }` runs on the host, with
    one warning per process."""
    from trace_rl.sandbox import SandboxConfig

    kind = runtime.get("type") if isinstance(runtime, dict) else None
    if kind == "subprocess":
        warn_host(name)
    if not (kind == TYPE_BWRAP or (runtime is None and own_harness)):
        return None
    try:
        sandbox = SandboxConfig.model_validate({key: value for key, value in (runtime or {}).items() if key != "type"})
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise EnvError(f"env 'verifiers': args.{name}.runtime.{where}: {problem['msg']} (docs/sandbox.md#keys)") \
            from None
    if not own_harness and sandbox.network == "none":
        raise EnvError(f"env 'verifiers': args.{name}.runtime.network: a verifiers harness in the sandbox reaches the "
                       "sampler on this host's loopback, which network = \"none\" cuts; set network = \"routes\" "
                       "(docs/sandbox.md#verifiers-own-harnesses)")
    return sandbox


_warned_host = False


def warn_host(seat: str) -> None:
    global _warned_host
    if not _warned_host:
        _warned_host = True
        logger.warning("env 'verifiers': args.%s.runtime = { type = \"subprocess\" } runs the programs of its "
                       "rollouts on this host, as this process's user, unsandboxed (docs/sandbox.md)", seat)


def sandboxed(config, sandboxes: dict) -> None:
    """Give the seats in `sandboxes` their runtime: their SandboxConfig's sandbox, or (None) the host; verifiers
    checked them as subprocess seats. From here on, verifiers runs any other subprocess runtime sandboxed too
    (`trace_rl.sandbox.runtime.install`)."""
    from verifiers.v1.configs.agent import agent_config_fields

    from trace_rl.sandbox.runtime import BwrapConfig, HostConfig, install

    install()
    for name, seat in agent_config_fields(config).items():
        if name in sandboxes:
            seat.runtime = HostConfig() if sandboxes[name] is None else BwrapConfig.of(sandboxes[name])


def tools_on_host_network(config) -> None:
    """Give every toolset of the env config on verifiers' subprocess runtime (a task's or the taskset's) a sandbox
    with the host's network (`[env.args] tools_network = "host"`)."""
    from pydantic import BaseModel
    from verifiers.v1.mcp.toolset import SharedToolsetConfig, ToolsetConfig
    from verifiers.v1.runtimes.subprocess import SubprocessConfig

    from trace_rl.sandbox import SandboxConfig
    from trace_rl.sandbox.runtime import BwrapConfig

    def walk(node) -> None:
        if isinstance(node, ToolsetConfig | SharedToolsetConfig) and type(node.runtime) is SubprocessConfig:
            node.runtime = BwrapConfig.of(SandboxConfig(network="host"))
        if isinstance(node, BaseModel):
            for name in type(node).model_fields:
                walk(getattr(node, name))
        elif isinstance(node, list | tuple | dict):
            for item in node.values() if isinstance(node, dict) else node:
                walk(item)

    walk(config)


def find_uv() -> bool:
    """Whether verifiers' subprocesses find `uv`: on PATH, or installed beside this Python (`pip install uv`), whose
    folder then goes at the front of PATH."""
    if shutil.which("uv"):
        return True
    beside = os.path.dirname(sys.executable)
    if shutil.which("uv", path=beside) is None:
        return False
    os.environ["PATH"] = os.pathsep.join([beside, os.environ.get("PATH", "")])
    return True


def runtime_lack(kind: str, own_harness: bool) -> str | None:
    """What this machine lacks to run a harness in a runtime of type `kind`, or None. The subprocess runtime needs
    nothing for trace-rl's chat harness, and `uv` for verifiers' own (they install their program with it)."""
    if kind == TYPE_BWRAP:
        from trace_rl.sandbox import bwrap_lack

        lacking = bwrap_lack()
        if lacking or own_harness:
            return lacking
    local = kind in ("subprocess", TYPE_BWRAP)
    executable, key = ("uv", None) if local else RUNTIME_NEEDS.get(kind, (None, None))
    if local and own_harness:
        return None
    if kind in CONTAINER_ENGINES:
        from trace_rl.containers.engine import engine_problem

        return engine_problem(kind)
    if executable == "uv" and not find_uv():
        return "`uv` (`pip install uv` into this Python's environment, as `make setup` does, or put uv on PATH)"
    if executable and shutil.which(executable) is None:
        return f"`{executable}` on PATH"
    if key and not os.environ.get(key):
        return f"{key} set (an account of that sandbox provider)"
    return None


def check_runtimes(config, own_harness: str) -> None:
    """Every seat's runtime exists on this machine (verifiers' harnesses install and run their program in it)."""
    vf = verifiers_module()
    from verifiers.v1.configs.agent import agent_config_fields

    from trace_rl.sandbox.runtime import BwrapConfig

    for name, seat in agent_config_fields(config).items():
        harness = seat.harness.id if seat.harness is not None else vf.default_harness_id(config.taskset.id)
        kind = TYPE_BWRAP if isinstance(seat.runtime, BwrapConfig) else seat.runtime.type
        lacking = runtime_lack(kind, harness == own_harness)
        if lacking:
            raise EnvError(f"env 'verifiers': args.{name}: harness {harness!r} runs in the {kind!r} "
                           f"runtime, which needs {lacking}; this machine lacks it: give the seat another runtime "
                           f"(args.{name}.runtime) or trace-rl's chat harness (args.{name}.harness = "
                           f"{{ id = \"{own_harness}\" }})")
        if seat.runtime.type in CONTAINER_ENGINES:
            from trace_rl.containers.engine import image_problem
            from trace_rl.containers.image import default_tag

            missing = image_problem(seat.runtime.type, seat.runtime.image, seat.runtime.image == default_tag())
            if missing:
                raise EnvError(f"env 'verifiers': args.{name}.runtime.image: {missing}")


class RolloutModel:
    """The `trace_rl.verifiers.client.TurnSampler` of one rollout, on its Sampler: conversation k's turn t samples
    with seed derive_seed(derive_seed(rollout seed, k), t), as `Sampler.conversation` seeds trace-rl's own envs.
    Keeps the first error, so a retryable or fatal sampler error reaches the rollout loop as itself. A sampler that
    stops the rollout (a partial rollout's `SegmentCut`: any BaseException but a cancellation) cancels the episode
    (`episode`), which verifiers tears down as any cancelled one, and the rollout raises it once the episode ended."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.tokenizer = sampler.runtime.tokenizer
        self.end_of_turn = (sampler.runtime.config.stop_tokens or [None])[0]
        self.model = sampler.runtime.config.name
        self.max_model_len = sampler.runtime.config.max_model_len
        self.error: BaseException | None = None
        self.stop: BaseException | None = None
        self.episode: asyncio.Future | None = None

    async def generate(self, prompt_ids: list[int], *, conversation: int, turn: int) -> Generation:
        try:
            return await self.sampler.generate(prompt_ids, seed=derive_seed(derive_seed(self.sampler.seed,
                                                                                        conversation), turn))
        except Exception as exc:
            self.error = self.error or exc
            raise
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - verifiers' request handler would re-raise it to its HTTP server
            self.stop = self.stop or exc
            if self.episode is not None:
                self.episode.cancel()
            raise asyncio.CancelledError from None


class Serving:
    """verifiers' serving resources (its interception server, shared tool servers) for the rollouts in flight on
    one event loop: entered by the first, left when the last ends, held by a task of their own."""

    def __init__(self, env):
        self.env = env
        self.users = 0
        self.holder: asyncio.Task | None = None
        self.ready = asyncio.Event()
        self.done = asyncio.Event()

    async def hold(self) -> None:
        try:
            async with self.env.serving():
                self.ready.set()
                await self.done.wait()
        finally:
            self.ready.set()

    @contextlib.asynccontextmanager
    async def __call__(self):
        if self.holder is None:
            self.ready, self.done = asyncio.Event(), asyncio.Event()
            self.holder = asyncio.create_task(self.hold())
        holder = self.holder
        self.users += 1
        try:
            await self.ready.wait()
            if holder.done():
                holder.result()  # it failed to start: raise why
            yield
        finally:
            self.users -= 1
            if self.users == 0 and self.holder is holder:
                self.holder = None
                self.done.set()
                await asyncio.gather(holder, return_exceptions=True)


def select_config(select: dict[str, Any]):
    """verifiers' `SelectConfig` of `[[env]] select`; an EnvError naming the key when verifiers refuses it."""
    vf = verifiers_module()
    try:
        return vf.SelectConfig.model_validate(select)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise EnvError(f"env 'verifiers': select.{where}: {problem['msg']} (verifiers' SelectConfig)") from None


def selected(taskset, select, taskset_id: str):
    """The view of `taskset` that `select` (a SelectConfig, or None: every task) picks, as verifiers picks it; an
    EnvError in trace-rl's keys when verifiers refuses (a shuffle of an unbounded taskset, ...)."""
    if select is None:
        return taskset
    if select.shuffle and not taskset.select(select.model_copy(update={"shuffle": False, "skip": 0,
                                                                       "limit": None})).bounded:
        raise EnvError(f"env 'verifiers': select.shuffle: taskset {taskset_id!r} is infinite and a shuffle needs "
                       "every task: bound the selection with closed ranges first (select.include = { idx = "
                       "[\"0:1000\"] }; limit applies after the shuffle), or leave shuffle out to stream the tasks")
    try:
        return taskset.select(select)
    except ValueError as exc:
        raise EnvError(f"env 'verifiers': select: taskset {taskset_id!r}: "
                       f"{first_line(exc).replace('--select.', 'select.')}") from None


def check_tools(env) -> None:
    """Every seat's harness can serve the tools the taskset's tasks and the taskset itself declare (and its task
    and runtime fit), as verifiers checks each run (`validate_pairing`); an EnvError naming the seat."""
    from verifiers.v1.utils.compile import validate_pairing

    task_type = type(env.taskset).task_type()
    tools = [*task_type.toolsets(env.taskset.config.task), *env.taskset.toolsets(env.taskset.config)]
    for name, seat in env._agent_specs.items():
        try:
            validate_pairing(env._harnesses[name], task_type, seat.runtime, tools=tools)
        except ValueError as exc:
            raise EnvError(f"env 'verifiers': args.{name}: {first_line(exc).replace('--env.', 'args.')}") from None


@register_env("verifiers")
class VerifiersEnv(Environment):
    Options = VerifiersOptions
    plays_here = True  # the episodes play in this process, in the runtimes of this machine

    def __init__(self, args=None, select: dict[str, Any] | None = None):
        super().__init__(args)
        self.config = env_config(self.args.model_dump(), self.plays_here)
        self.select = None if select is None else select_config(select)
        self._env = None
        self._view = None
        self._tasks: list | None = None
        self._streamed: dict[int, Any] = {}
        self._serving: Serving | None = None

    @classmethod
    def check_config(cls, options: BaseModel) -> list[str]:
        return cls.selection_problems(options.model_dump(), None)

    @classmethod
    def drive_again_problem(cls, options: BaseModel) -> str | None:
        """A seat whose harness runs code in its runtime, a task that needs a container, or a taskset class that
        sets `drivable_again = False` (tools with side effects): driving an episode again would repeat them. And
        verifiers' own retries, which start an episode's calls over within one drive."""
        try:
            env = cls(options.model_dump()).vf_env
        except EnvError:
            return None  # check_config names it
        retries = [("args.retries", env.config.retries),
                   *((f"args.{name}.retries", seat.retries) for name, seat in env._agent_specs.items())]
        for where, config in retries:
            if config.max_retries or any(rule.max_retries for rule in config.rules):
                return f"{where}: verifiers' retries start an episode's calls over; leave them out"
        for name, harness in env._harnesses.items():
            if type(harness).EXECUTES_CODE:
                return f"args.{name}: harness {type(harness).__name__} runs code in its runtime"
        taskset = type(env.taskset)
        if taskset.task_type().NEEDS_CONTAINER:
            return f"taskset {taskset.__name__}: its tasks need a container"
        if not getattr(taskset, "drivable_again", True):
            return f"taskset {taskset.__name__} sets drivable_again = False"
        return None

    @classmethod
    def selection_problems(cls, args: dict[str, Any], select: dict[str, Any] | None) -> list[str]:
        """What step 1 would refuse, found by loading the env as a step does: verifiers' refusal of `[env.args]`
        or `select`, a runtime this machine lacks, a harness that cannot run the taskset's tools, a selection
        that verifiers cannot make (a shuffle of an unbounded taskset) or that picks no task, tasks that cannot
        load (of a stream: its first), and a task whose prompt shows the model an image."""
        from trace_rl.verifiers.client import images_problem

        try:
            env = cls(args, select)
            env.check_loaded()
            tasks = env.tasks if env.bounded else env.taken(0, 1)
        except EnvError as exc:
            return [str(exc)]
        for index, task in enumerate(tasks):
            problem = images_problem(task.data.prompt if isinstance(task.data.prompt, list) else ())
            if problem is not None:
                return [f"env 'verifiers': taskset {env.config.taskset.id!r}, task {index}: {problem}"]
        return []

    def check_loaded(self) -> None:
        check_tools(self.vf_env)

    @property
    def vf_env(self):
        if self._env is None:
            vf = verifiers_module()
            from trace_rl.verifiers.client import install

            install()
            self.sweep_containers()
            try:
                self._env = vf.load_environment(self.config)
            except Exception as exc:  # noqa: BLE001 - the env's or taskset's own constructor refused
                raise EnvError(f"env 'verifiers': cannot load {self.config.env_id!r}: {type(exc).__name__}: "
                               f"{first_line(exc)}") from None
        return self._env

    def sweep_containers(self) -> None:
        """Before a container seat's first rollout: label this process's containers with its pid, remove those
        of trace-rl processes that are gone (a run killed with rollouts in flight, resumed here), and start a
        restricted podman seat's rollouts in one container each (`trace_rl.containers.runtime`)."""
        from verifiers.v1.configs.agent import agent_config_fields

        from trace_rl.containers.engine import claim_scope, sweep
        from trace_rl.containers.runtime import install

        engines = {seat.runtime.type for seat in agent_config_fields(self.config).values()} & set(CONTAINER_ENGINES)
        if engines:
            claim_scope()
            install()
        for engine in engines:
            if removed := sweep(engine):
                logger.warning("removed %d %s containers that trace-rl processes killed earlier left behind: %s",
                               len(removed), engine, ", ".join(removed))

    def taskset(self):
        """The verifiers taskset the tasks come from: the loaded env's."""
        return self.vf_env.taskset

    def view(self):
        """The taskset as `[[env]] select` picks it."""
        if self._view is None:
            self._view = selected(self.taskset(), self.select, self.config.taskset.id)
        return self._view

    @property
    def bounded(self) -> bool:
        """Whether the selected tasks end (else they are a stream)."""
        return self.view().bounded

    def taken(self, start: int, stop: int | None) -> list:
        """The selected tasks at positions start ... stop - 1 (None: to the end); an EnvError with the taskset's
        own error when its tasks cannot load (a dataset that is not there)."""
        try:
            return list(itertools.islice(self.view(), start, stop))
        except EnvError:
            raise
        except Exception as exc:  # noqa: BLE001 - the taskset's own loader failed
            raise EnvError(f"env 'verifiers': taskset {self.config.taskset.id!r} cannot load its tasks: "
                           f"{type(exc).__name__}: {first_line(exc)}") from None

    @property
    def tasks(self) -> list:
        """Every selected task, of a bounded selection."""
        if self._tasks is None:
            self._tasks = self.taken(0, None)
            if not self._tasks:
                raise EnvError(f"env 'verifiers': taskset {self.config.taskset.id!r} has no tasks"
                               + (" that select picks" if self.select is not None else ""))
        return self._tasks

    def streamed(self, start: int, count: int) -> list[Example]:
        """The stream's tasks at positions start ... start + count - 1, as examples `task<position>`."""
        tasks = self.taken(start, start + count)
        if len(tasks) < count:
            raise EnvError(f"env 'verifiers': the stream of taskset {self.config.taskset.id!r} ended at position "
                           f"{start + len(tasks)}; it is not infinite: bound it with select.limit")
        self._streamed.update(enumerate(tasks, start))
        return [Example(id=f"task{position}", data={"task": position}) for position in range(start, start + count)]

    def task_at(self, example: Example):
        """The verifiers task of an example this env gave."""
        return self.tasks[example.data["task"]] if self.bounded else self._streamed[example.data["task"]]

    def order(self, run_seed: int, env_index: int, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(derive_seed(run_seed, env_index, epoch)).shuffle(order)
        return order

    def examples_for_step(self, run_seed: int, step: int, env_index: int, count: int) -> list[Example]:
        """Tasks (step - 1) * count ... step * count - 1 of the epoch-after-epoch stream of a bounded selection's
        tasks, or of the stream of an unbounded one."""
        if not self.bounded:
            return self.streamed((step - 1) * count, count)
        stream = epoch_stream(step, count, len(self.tasks), lambda epoch: self.order(run_seed, env_index, epoch))
        return [Example(id=f"task{task}-e{epoch}", data={"task": task}) for epoch, task in stream]

    def examples(self, seed: int, count: int) -> list[Example]:
        """Up to `count` distinct tasks drawn with `seed`; of a stream, `count` tasks from position seed mod
        STREAM_DRAW_SPAN."""
        if not self.bounded:
            return self.streamed(seed % STREAM_DRAW_SPAN, count)
        picked = random.Random(seed).sample(range(len(self.tasks)), min(count, len(self.tasks)))
        return [Example(id=f"task{index}", data={"task": index}) for index in picked]

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        vf = verifiers_module()
        from trace_rl.verifiers.client import client_config, register_sampler, unregister_sampler

        env, task = self.vf_env, self.task_at(example)
        if self._serving is None:
            self._serving = Serving(env)
        key, model = uuid.uuid4().hex, RolloutModel(sampler)
        sampling = vf.SamplingConfig(temperature=sampler.sampling.temperature, top_p=sampler.sampling.top_p,
                                     max_tokens=sampler.sampling.max_completion_tokens)
        context = vf.ModelContext(model=sampler.runtime.config.name, client=client_config(key), sampling=sampling)
        register_sampler(key, model)
        try:
            async with self._serving():
                (slot,) = env.slots(task, 1)
                model.episode = asyncio.ensure_future(env.run_slot(slot, context))
                try:
                    episode = await model.episode
                except asyncio.CancelledError:
                    if model.stop is None:
                        raise
                    raise model.stop from None
        finally:
            unregister_sampler(key)
        if isinstance(model.error, (FatalError, RetryableError, TimeoutError)):
            raise model.error
        return episode_traces(episode, self.id, example)


def episode_traces(episode, env_id: str, example: Example) -> list[Trace]:
    """The trace-rl traces of a verifiers episode (played here or on an env server); an EnvError with verifiers'
    first error when it failed."""
    from trace_rl.verifiers.convert import trace_from_vf

    if not episode.ok:
        errors = [*episode.errors, *(trace.last_error for trace in episode.traces if trace.last_error)]
        reason = f"{errors[0].type}: {errors[0].message}" if errors else "the episode did not finish"
        if errors and errors[0].type == "SandboxError" and errors[0].message.startswith(CONTAINER_NOT_STARTED):
            raise RetryableError(f"verifiers episode of task {example.id}: {reason}")
        raise EnvError(f"verifiers episode of task {example.id} failed: {reason}")
    return [trace_from_vf(trace, env=env_id, example_id=example.id) for trace in episode.traces]
