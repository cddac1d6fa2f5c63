"""Prefect flows: a training run (`train`), one step (`train_step`) and offline replay (`replay`)."""
