"""The trainer: packed micro-batches, the rl and ce losses, checkpoints and HF weights (docs/trainer.md).

Import `Trainer` from `trace_rl.trainer.trainer` (it pulls in transformers);
`train_one_step` from `trace_rl.trainer.run` is cheap to import.
"""
