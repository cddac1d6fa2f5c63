"""The `trace-rl` command line. It lives with the flows because it launches them: the library
(`trace_rl/`) never imports Prefect, the flows or this module.

Commands import heavy modules (torch, vllm, prefect) only when they run, so
`trace-rl train CONFIG --dry-run` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from flows import quiet
from trace_rl.config import Config, ConfigError, config_to_toml
from trace_rl.errors import FatalError, RefusedError
from trace_rl.inference.vllm_logging import quiet_imports, verbose
from trace_rl.machine import reaper
from trace_rl.runs.loading import load_config

# vLLM's spawned processes (EngineCore and its worker) run this main module first, so this drops the
# known-harmless warning vLLM logs on import there too (unless TRACE_RL_VERBOSE is set)
quiet_imports()

# Like `python -m`: modules in the working directory import, so a config can name `mypkg.algos:MyAlgorithm`
# for ./mypkg/algos.py (docs/algorithms.md). Appended: a file there never shadows an installed package.
if os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())

DESCRIPTION = ("RL post-training on token-exact traces, every training step a Prefect flow run: train, evaluate, "
               "replay and export runs, and serve them as deployments (README.md, docs/).")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set trainer.lr=1e-5 --set env.0.group_size=4",
    )


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="show every log line (Prefect's INFO lines, all of vLLM's output) instead of progress")


def _load(args) -> Config:
    return load_config(args.config, args.overrides, on_this_machine=True)  # train and serve run it here


class RunFailureReports(logging.Filter):
    """Drops what Prefect's engines log when a task or flow run fails (ERROR lines with the traceback, the same
    failure once per enclosing run): the command ends with that failure in one `error:` line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or not record.name.startswith(("prefect.task_runs", "prefect.flow_runs"))


def _no_failure_tracebacks() -> None:
    """Prefect's console shows no run failure reports (the UI keeps them), unless --verbose."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    if verbose():
        return
    ensure_logging_setup()  # later setups are incremental: they keep the handlers and this filter
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            handler.addFilter(RunFailureReports())


def _prefect(configured: str | None = None) -> str:
    """Point this process at the Prefect server (starting the embedded one if none is set) and make sure it
    marks our flow runs Crashed when their heartbeats stop (flows/liveness.py)."""
    from flows.prefect_server import ensure_api_url

    api_url = ensure_api_url(configured)
    print(f"Prefect API: {api_url} (UI: {api_url.removesuffix('/api')})", file=sys.stderr)
    _no_failure_tracebacks()
    from flows.liveness import ensure_zombie_automation

    ensure_zombie_automation()
    return api_url


def cmd_train(args) -> int:
    config = _load(args)
    if args.dry_run:
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(config_to_toml(config), "toml", theme="ansi_dark", background_color="default"))
        return 0
    from trace_rl.runs.preflight import check_reachable
    from trace_rl.runs.start import check_run, finished_message

    storage = args.storage = check_run(config, "resume" if args.resume else "overwrite" if args.overwrite else "new")
    finished = finished_message(config, storage) if args.resume else None
    if finished is not None:  # nothing to run: no Prefect server, no flow run
        print(finished, file=sys.stderr)
        return 0
    check_reachable(config)  # env and vLLM servers, before step 1 and before any engine starts
    _prefect(config.prefect.api_url)
    from flows.liveness import refuse_if_running

    refuse_if_running(storage.url)
    reaper.start()
    quiet.progress_bars()
    from flows.train import run_training

    try:
        run_training(config, resume=args.resume, overwrite=args.overwrite)
    finally:
        quiet.stop_engines()
    return 0


def cmd_trainer_node(args) -> int:
    """Node K of a run with `trainer.nnodes > 1`: its workers join every session node 0 starts, until the run ends."""
    from trace_rl.trainer.nodes import check_node, serve_node

    config = load_config(args.config, args.overrides)
    check_node(config, args.node_rank)  # refused in one line before anything starts
    if args.wait_s is not None and args.wait_s < 0:
        raise RefusedError(f"--wait-s {args.wait_s:g}: must be 0 or more (seconds to wait for node 0's session)")
    reaper.start()
    serve_node(config, args.node_rank, args.wait_s, say=lambda line: print(line, file=sys.stderr))
    return 0


def cmd_eval(args) -> int:
    from trace_rl.eval.evaluation import check_eval
    from trace_rl.offline.replay import source_config

    config = source_config(args.run, overrides=args.overrides, flag="RUN")
    check_eval(config, args.step)
    _prefect(config.prefect.api_url)
    reaper.start()
    quiet.progress_bars()
    from flows.eval import run_eval

    try:
        run_eval(config, args.step)
    finally:
        quiet.stop_engines()
    return 0


def cmd_replay(args) -> int:
    from trace_rl.offline.replay import (
        check_records_replay, check_replay, check_source, check_train_start, parse_algorithms,
    )

    check_source(args.run, args.traces)
    algorithms = parse_algorithms(args.algorithms)
    if args.traces is not None:
        plan = check_records_replay(args.traces, algorithms, args.out, args.steps, args.overwrite,
                                    overrides=args.overrides)
    else:
        plan = check_replay(args.run, algorithms, args.out, args.steps, args.overwrite, overrides=args.overrides)
    check_train_start(plan.source, plan.source_storage, args.train, args.from_step, args.model,
                      records=args.traces is not None)
    _prefect()
    reaper.start()
    quiet.progress_bars()
    from flows.replay import replay_flow

    try:
        replay_flow(run=args.run, algorithms=algorithms, out=args.out, steps=args.steps, train=args.train,
               from_step=args.from_step, model=args.model, overwrite=args.overwrite, overrides=args.overrides,
               traces=args.traces)
    finally:
        quiet.stop_engines()
    return 0


def cmd_serve(args) -> int:
    config = _load(args)
    api_url = _prefect(config.prefect.api_url)
    print(f"serving deployments of {config.name!r}; start runs from the UI: {api_url.removesuffix('/api')}",
          file=sys.stderr)
    reaper.start()
    from flows.serve import serve_config

    serve_config(config, cron=args.cron)
    return 0


def cmd_server(args) -> int:
    from flows import prefect_server

    if args.action == "start":
        record = prefect_server.start()
        print(f"Prefect server running (pid {record['pid']}): UI {record['ui_url']}  API {record['api_url']}")
        os.environ["PREFECT_API_URL"] = record["api_url"]  # this command is about the embedded server
        from flows.liveness import crash_gone_runs, crash_orphaned_subflows, ensure_zombie_automation

        ensure_zombie_automation()
        for run in crash_gone_runs(None, "found by `trace-rl server start`"):
            print(f"marked the flow run {run.name} ({run.id}) Crashed: the process that ran it is gone")
        for run in crash_orphaned_subflows("found by `trace-rl server start`"):
            print(f"marked the subflow run {run.name} ({run.id}) Crashed: its parent flow run has ended")
    elif args.action == "stop":
        print("stopped" if prefect_server.stop() else "no embedded server was running")
    else:
        record = prefect_server.status()
        print(f"running (pid {record['pid']}): UI {record['ui_url']}" if record else "not running")
        return 0 if record else 1
    return 0


def cmd_export(args) -> int:
    from trace_rl.offline.export import export_step

    for path in export_step(args.run, args.step, merged=args.merged, adapter=args.adapter):
        print(f"wrote {path}")
    return 0


def cmd_export_traces(args) -> int:
    from trace_rl.offline.export_traces import export_traces

    count, steps = export_traces(args.run, args.out, args.steps, args.overwrite)
    print(f"wrote {count} verifiers trace records of steps {steps[0]}..{steps[-1]} to {args.out}")
    return 0


def cmd_view(args) -> int:
    from trace_rl.offline.episodes_html import write_episodes_page
    from trace_rl.offline.replay import saved_steps, source_config
    from trace_rl.storage import RunStorage

    config = source_config(args.run, flag="RUN")
    saved = saved_steps(RunStorage.of(config))
    if args.step not in saved:
        raise RefusedError(f"--step {args.step}: {args.run} has no saved traces of that step (saved: "
                           f"{', '.join(map(str, saved)) or 'none'})")
    print(f"wrote {write_episodes_page(config, args.step, rescore=args.rescore)}")
    return 0


def cmd_config_schema(args) -> int:
    print(json.dumps(Config.model_json_schema(), indent=2))
    return 0


def cmd_sandbox(args) -> int:
    from trace_rl.containers.image import build

    print(build(args.tag, args.engine, args.force, log=lambda line: print(line, file=sys.stderr)))
    return 0


def cmd_env_server(args) -> int:
    from trace_rl.remote.server import EnvServerError, Limits, serve

    limits = Limits(max_request_bytes=int(args.max_request_mb * 2**20), request_timeout_s=args.request_timeout_s,
                    max_concurrent=args.max_concurrent, max_models=args.max_models, rate_per_s=args.rate_limit)
    try:
        serve(args.allow, args.host, args.port, args.token_file, limits)
    except EnvServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_verifiers_env_server(args) -> int:
    from trace_rl.envs.verifiers_env_server import serve

    config = load_config(args.config, args.overrides, on_this_machine=True)
    envs = config.env if args.env < len(config.env) else []
    if not envs or not envs[args.env].verifiers_server:
        raise RefusedError(f"--env {args.env}: env.{args.env} of {args.config} is not a verifiers env with a "
                           "server = \"tcp://HOST:PORT\"; name one that is")
    env = envs[args.env]
    print(f"serving env.{args.env} ({env.args.get('taskset')}) at {env.verifiers_server}", flush=True)
    serve(env.args, env.verifiers_server, env.import_paths)
    return 0


class Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other refusal of the command line (not the usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="trace-rl", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training run (or --dry-run to print the resolved config)")
    _add_config_args(train)
    train.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue an existing run from its latest checkpoint")
    mode.add_argument("--overwrite", action="store_true", help="wipe an existing run directory first")
    _add_verbose(train)
    train.set_defaults(func=cmd_train)

    node = sub.add_parser("trainer-node", help="run node K's trainer workers of a multi-node run (trainer.nnodes > 1; "
                          "node 0 runs `train`, docs/scaling.md)")
    _add_config_args(node)
    node.add_argument("--node-rank", type=int, required=True, help="this machine's node rank, 1 .. trainer.nnodes - 1")
    node.add_argument("--wait-s", type=float, help="how long to wait for the run to appear and for node 0 to start "
                      "its session, and again after each session (default: the rendezvous timeout, "
                      "trainer.join_timeout_s + 60)")
    _add_verbose(node)
    node.set_defaults(func=cmd_trainer_node)

    serve = sub.add_parser("serve", help="serve the train, eval and replay flows as deployments (runs start from the "
                           "UI)")
    _add_config_args(serve)
    serve.add_argument("--cron", help='a schedule for the training deployment, e.g. "0 * * * *"')
    _add_verbose(serve)
    serve.set_defaults(func=cmd_serve)

    replay = sub.add_parser("replay", help="run saved traces through new algorithms into new batches, offline")
    replay.add_argument("--run", help="the source run: <storage>/<name>")
    replay.add_argument("--traces", metavar="FILE", help="instead of --run: a file of verifiers v1 trace records "
                        "(JSON lines of vf.Trace.to_record(), or verifiers' traces.jsonl; *.msgpack: msgpack)")
    replay.add_argument("--algorithms", required=True, help='a TOML array, e.g. \'["opd", {id="echo"}]\'')
    replay.add_argument("--out", required=True, help="where the replayed batches go (never the source run)")
    replay.add_argument("--steps", help="FIRST:LAST, inclusive (default: every saved step)")
    replay.add_argument("--train", action="store_true", help="train a model on the replayed batches")
    replay.add_argument("--overwrite", action="store_true", help="wipe a non-empty --out first")
    replay.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a key of the source run's config (with --traces: of trace-rl's defaults), e.g. --set "
             "models.reference.name=tiny for opd",
    )
    start = replay.add_mutually_exclusive_group()
    start.add_argument("--from-step", type=int, help="with --train: start from the run's weights of this step")
    start.add_argument("--model", help="with --train: start from this model (default: the run's base model)")
    _add_verbose(replay)
    replay.set_defaults(func=cmd_replay)

    evaluate = sub.add_parser("eval", help="evaluate a run's weights of one step on its [eval] envs (docs/eval.md)")
    evaluate.add_argument("run", help="the run: <storage>/<name>")
    evaluate.add_argument("--step", type=int, required=True, help="the step whose weights to evaluate (0: the base "
                          "model)")
    evaluate.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a key of the run's config, e.g. --set eval.k=8 --set eval.num_examples=50",
    )
    _add_verbose(evaluate)
    evaluate.set_defaults(func=cmd_eval)

    export = sub.add_parser("export", help="write a step's weights as merged Hugging Face weights or a peft adapter")
    export.add_argument("run", help="the run: <storage>/<name>")
    export.add_argument("--step", type=int, required=True, help="the training step whose weights to export")
    export.add_argument("--merged", metavar="DIR", help="full HF weights (a LoRA run: base + adapter merged)")
    export.add_argument("--adapter", metavar="DIR", help="the peft adapter of a LoRA run")
    export.set_defaults(func=cmd_export)

    export_traces = sub.add_parser("export-traces", help="write a run's saved traces as verifiers v1 trace records")
    export_traces.add_argument("run", help="the run: <storage>/<name>")
    export_traces.add_argument("--steps", help="FIRST:LAST, inclusive (default: every saved step)")
    export_traces.add_argument("--out", required=True, metavar="FILE",
                               help="the records file: JSON lines, or msgpack if it ends in .msgpack")
    export_traces.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    export_traces.set_defaults(func=cmd_export_traces)

    view = sub.add_parser("view", help="write a step's episodes as a web page beside it (steps/<step>/episodes.html)")
    view.add_argument("run", help="the run: <storage>/<name>")
    view.add_argument("--step", type=int, required=True, help="the step whose episodes to show")
    view.add_argument("--rescore", action="store_true", help="recompute the trainer's logprobs (transformers, "
                      "float32, the weights the trainer trained from at that step) to show the sampler-trainer gap "
                      "per token")
    view.set_defaults(func=cmd_view)

    server = sub.add_parser("server", help="manage the embedded Prefect server (UI at http://127.0.0.1:4200)")
    server.add_argument("action", choices=["start", "stop", "status"])
    server.set_defaults(func=cmd_server)

    schema = sub.add_parser("config-schema", help="print the JSON schema of the config")
    schema.set_defaults(func=cmd_config_schema)

    sandbox = sub.add_parser("sandbox", help="build the default image of verifiers' podman/docker runtimes here, from "
                             "Debian's packages and PyPI, no registry needed (docs/containers.md#images)")
    sandbox.add_argument("action", choices=["build"])
    sandbox.add_argument("--engine", choices=["podman", "docker"], default="podman")
    sandbox.add_argument("--tag", help="import it under this tag (default: localhost/trace-rl-sandbox:<recipe hash>, "
                         "the image a podman runtime without `image` runs)")
    sandbox.add_argument("--force", action="store_true", help="rebuild even if the image or its cached root exists")
    sandbox.set_defaults(func=cmd_sandbox)

    server = sub.add_parser("env-server", help="serve the envs and algorithms of your modules (docs/remote.md)")
    server.add_argument("--allow", action="append", required=True, metavar="MODULE[:CLASS]",
                        help="what requests may run besides builtins: a module (all it registers) or one "
                             "module:Class (repeatable); nothing else is ever imported")
    server.add_argument("--host", default="127.0.0.1", help="bind address; beyond loopback needs --token-file")
    server.add_argument("--port", type=int, default=8765)
    server.add_argument("--token-file", help="file holding the bearer tokens (one per line) requests must send")
    server.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body (413 beyond)")
    server.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request time limit (504 beyond)")
    server.add_argument("--max-concurrent", type=int, default=8, help="requests run at once (503 beyond)")
    server.add_argument("--max-models", type=int, default=4, help="model runtimes kept built (LRU evicted beyond)")
    server.add_argument("--rate-limit", type=float, default=100.0,
                        help="requests per second per token (429 beyond; bursts of 2 s worth; 0 = no limit)")
    server.set_defaults(func=cmd_env_server)

    vf_server = sub.add_parser("verifiers-env-server", help="serve a run's verifiers env on a verifiers env server, "
                                                             "at its server = \"tcp://HOST:PORT\" (docs/remote.md)")
    _add_config_args(vf_server)
    vf_server.add_argument("--env", type=int, default=0, help="which [[env]] of the config (0-based)")
    vf_server.set_defaults(func=cmd_verifiers_env_server)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    if hasattr(args, "verbose"):
        quiet.by_default(verbose)
    try:
        return args.func(args)
    except ConfigError as exc:  # checked before any flow run starts: the message is the news
        print("\n".join(f"error: {problem}" for problem in exc.problems), file=sys.stderr)
        return 2
    except RefusedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a step failed: its cause in one line (the traceback is in the UI, or --verbose)
        if verbose:
            traceback.print_exc()
        print(f"error: {failure_line(exc, args)}", file=sys.stderr)
        return 1


def failure_line(exc: BaseException, args) -> str:
    """The cause of a failed command and how to go on: a failed training step leaves the run resumable."""
    line = str(exc) if isinstance(exc, FatalError) else f"{type(exc).__name__}: {exc}"
    if args.command == "train":
        line += f"; {next_move(args)}"
    return line if getattr(args, "verbose", True) else f"{line} (--verbose shows the traceback)"


def next_move(args) -> str:
    """After a failed `train`: run it again where nothing trained yet, else continue it."""
    from trace_rl.runs.start import run_exists
    from trace_rl.storage import first_unfinished_step

    command = f"trace-rl train {args.config}" + "".join(f" --set {o}" for o in args.overrides)
    storage = getattr(args, "storage", None)  # set once the run's directory was checked
    if storage is None or not run_exists(storage):
        return f"fix that and run `{command}` again"
    if first_unfinished_step(storage) == 1:
        return f"fix that and run again with `{command} --resume` (no step finished yet)"
    return f"fix that and continue the run with `{command} --resume`"


if __name__ == "__main__":
    sys.exit(main())
