"""The trainer: packed micro-batches, the rl and ce losses, checkpoints and HF weights (docs/trainer.md).

Import `Trainer` from `trace_rl.trainer.trainer` (it pulls in transformers);
`RunTrainer` and `train_one_step` from `trace_rl.trainer.lifecycle` are cheap to import.
"""
