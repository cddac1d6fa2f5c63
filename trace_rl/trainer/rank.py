"""One torchrun rank of the persistent trainer workers (launched by `trace_rl.trainer.launcher.TrainerWorkers`
on node 0, and by `trace-rl trainer-node` on the other nodes of a multi-node run).

    python -m torch.distributed.run --standalone --nproc_per_node N -m trace_rl.trainer.rank \\
        --control DIR --config FILE --parent PID:START [--node-rank K]

gloo on CPU; on CUDA nccl, and gloo for CPU tensors (offloaded shards). The rank restores the
latest checkpoint, writes `ready-<rank>.json`, then serves the numbered commands of the control
directory `DIR` in order: `{"step": S, "extra_state": NAME}` trains step S on its batch and joins in
writing the checkpoint and the weights (rank 0 writes, then writes `result-<n>.json`);
`{"stop": true}` ends it. An error is written to `error-<rank>.json` and ends the rank (torchrun
then stops the others). The rank also ends as soon as its launcher `PID` is gone, whatever it is doing.
With one node `DIR` is a private local directory; with `trainer.nnodes > 1` it is the session's directory in the run's
storage (trace_rl/trainer/nodes.py). `FILE` is the config with its credentials, local to this machine.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from trace_rl.config import Config
from trace_rl.machine import processes
from trace_rl.storage import RunStorage
from trace_rl.trainer.lifecycle import restore_trainer, train_in_process
from trace_rl.trainer.nodes import ControlDir, worker_control_dir
from trace_rl.trainer.trainer import resolve_device


def exit_without_launcher(parent: int, parent_start: int, poll_s: float) -> None:
    """End this rank as soon as its launcher is gone, whatever it is doing: a rank blocked in the process group's
    rendezvous or in a collective whose peer died would never come back to look. Nobody waits for it then."""

    def watch() -> None:
        while processes.is_alive(parent, parent_start):
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def next_command(control_dir: ControlDir, n: int) -> dict[str, Any]:
    """Wait for `command-<n>.json`."""
    while (command := control_dir.read_json(f"command-{n}.json")) is None:
        time.sleep(control_dir.poll_s)
    return command


def serve(config: Config, control_dir: ControlDir, node_rank: int) -> None:
    storage = RunStorage.of(config)
    trainer, restored = restore_trainer(config, storage)  # the launcher checks the step it sends against `restored`
    rank = dist.get_rank()
    me = processes.stat(os.getpid())
    control_dir.write_json(f"ready-{rank}.json", {"pid": os.getpid(), "start": me.start, "restored": restored,
                                              "node": node_rank, "host": socket.gethostname()})
    n = 0
    while not (command := next_command(control_dir, n)).get("stop"):
        extra_state = torch.load(io.BytesIO(control_dir.read(command["extra_state"])), weights_only=False)
        metrics = train_in_process(trainer, storage, command["step"], extra_state)
        if trainer.device.type == "cuda":
            torch.cuda.empty_cache()  # the step's freed activations: colocated engines wake up into that memory
        if rank == 0:
            control_dir.write_json(f"result-{n}.json", metrics)
        n += 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--control", required=True, help="the launcher's control directory")
    parser.add_argument("--config", help="the config as JSON (default: config.json in the control directory)")
    parser.add_argument("--parent", required=True, help="PID:START of the launcher (start: clock ticks after boot)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's node rank (trainer.nnodes > 1)")
    args = parser.parse_args(argv)
    parent, parent_start = (int(part) for part in args.parent.split(":"))

    with open(args.config or os.path.join(args.control, "config.json")) as f:
        config = Config.model_validate_json(f.read())
    control_dir = worker_control_dir(config, args.control)
    exit_without_launcher(parent, parent_start, control_dir.poll_s)
    device = resolve_device(config.trainer.device, int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # CPU-offloaded shards (trainer.cpu_offload) are gathered for checkpoints and clipped on the CPU: gloo
    dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo")
    try:
        serve(config, control_dir, args.node_rank)
    except BaseException:
        control_dir.write_json(f"error-{dist.get_rank()}.json", {"node": args.node_rank, "error": traceback.format_exc()})
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
