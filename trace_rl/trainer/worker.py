"""One torchrun rank of the persistent trainer workers (launched by `trace_rl.trainer.workers.TrainerWorkers`).

    python -m torch.distributed.run --standalone --nproc_per_node N -m trace_rl.trainer.worker \\
        --control DIR --parent PID:START

gloo on CPU; on CUDA nccl, and gloo for CPU tensors (offloaded shards). The rank restores the
latest checkpoint, writes `ready-<rank>.json`, then serves the numbered commands of the control
directory in order: `{"step": S, "extra_state": PATH}` trains step S on its batch and joins in
writing the checkpoint and the weights (rank 0 writes, then writes `result-<n>.json`);
`{"stop": true}` ends it. An error is written to `error-<rank>.json` and ends the rank (torchrun
then stops the others). The rank also ends when the launcher `PID` is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from trace_rl import processes
from trace_rl.config import Config
from trace_rl.storage import RunStorage
from trace_rl.trainer.run import train_in_process
from trace_rl.trainer.trainer import Trainer, resolve_device
from trace_rl.trainer.workers import POLL_S, write_json_atomic


class LauncherGone(RuntimeError):
    pass


def next_command(control: str, n: int, parent: int, parent_start: int) -> dict[str, Any]:
    """Wait for `command-<n>.json` while the launcher lives."""
    path = os.path.join(control, f"command-{n}.json")
    while not os.path.exists(path):
        if not processes.is_alive(parent, parent_start):
            raise LauncherGone(f"the launcher (pid {parent}) is gone")
        time.sleep(POLL_S)
    with open(path) as f:
        return json.load(f)


def serve(control: str, parent: int, parent_start: int) -> None:
    with open(os.path.join(control, "config.json")) as f:
        config = Config.model_validate_json(f.read())
    storage = RunStorage(config.storage, config.name, config.storage_options)
    trainer = Trainer(config, storage)
    restored, _ = trainer.restore()
    rank = dist.get_rank()
    me = processes.stat(os.getpid())
    write_json_atomic(os.path.join(control, f"ready-{rank}.json"),
                      {"pid": os.getpid(), "start": me.start, "restored": restored})
    n = 0
    while not (command := next_command(control, n, parent, parent_start)).get("stop"):
        extra_state = torch.load(command["extra_state"], weights_only=False)
        metrics = train_in_process(trainer, storage, command["step"], extra_state)
        if trainer.device.type == "cuda":
            torch.cuda.empty_cache()  # the step's freed activations: colocated engines wake up into that memory
        if rank == 0:
            write_json_atomic(os.path.join(control, f"result-{n}.json"), metrics)
        n += 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--control", required=True, help="the launcher's control directory")
    parser.add_argument("--parent", required=True, help="PID:START of the launcher (start: clock ticks after boot)")
    args = parser.parse_args(argv)
    parent, parent_start = (int(part) for part in args.parent.split(":"))

    with open(os.path.join(args.control, "config.json")) as f:
        device = resolve_device(Config.model_validate_json(f.read()).trainer.device, int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # CPU-offloaded shards (trainer.cpu_offload) are gathered for checkpoints and clipped on the CPU: gloo
    dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo")
    try:
        serve(args.control, parent, parent_start)
    except LauncherGone:
        os._exit(0)  # nobody waits for this rank; the others see the same and exit too
    except BaseException:
        write_json_atomic(os.path.join(args.control, f"error-{dist.get_rank()}.json"), traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
