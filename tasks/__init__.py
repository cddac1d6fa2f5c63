"""Prefect tasks: one pipeline stage per module, each a thin wrapper over trace_rl.pipeline.step."""
