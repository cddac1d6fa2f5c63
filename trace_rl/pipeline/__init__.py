"""One training step's stages as plain functions (docs/pipeline.md), the per-process session that keeps
the models and the trainer warm between steps, and which engines a run starts."""
