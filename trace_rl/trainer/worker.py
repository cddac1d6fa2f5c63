"""One torchrun rank of a distributed training step (launched by `trace_rl.trainer.run.launch_workers`).

    python -m torch.distributed.run --standalone --nproc_per_node N -m trace_rl.trainer.worker \\
        --config config.json --step S --extra-state extra.pt --metrics metrics.json

gloo on CPU, nccl on CUDA. Every rank restores the latest checkpoint, trains on the
step's batch, and joins in writing the checkpoint and the weights (rank 0 writes).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from trace_rl.config import Config
from trace_rl.storage import RunStorage
from trace_rl.trainer.run import check_resumes_at, train_in_process
from trace_rl.trainer.trainer import Trainer, resolve_device


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run config as JSON")
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--extra-state", required=True, help="torch file with the algorithms' state to checkpoint")
    parser.add_argument("--metrics", required=True, help="where rank 0 writes the step metrics as JSON")
    args = parser.parse_args(argv)

    with open(args.config) as f:
        config = Config.model_validate_json(f.read())
    device = resolve_device(config.trainer.device, int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        storage = RunStorage(config.storage, config.name, config.storage_options)
        trainer = Trainer(config, storage)
        restored, _ = trainer.restore()
        check_resumes_at(restored, args.step)
        extra_state = torch.load(args.extra_state, weights_only=False)
        metrics = train_in_process(trainer, storage, args.step, extra_state)
        if dist.get_rank() == 0:
            with open(args.metrics, "w") as f:
                json.dump(metrics, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
