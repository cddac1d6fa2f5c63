"""verifiers v1 (`import verifiers.v1 as vf`) traces in trace-rl: conversion both ways (`convert`), the records
files of `replay --traces` and `export-traces` (`records`), the check that the optional package is there
(`extra`), and what runs verifiers envs on the run's sampler (the env itself is `trace_rl.envs.verifiers_env`): its
model client (`client`), in-process chat harness (`harness`) and the MCP tool calls it makes (`mcp_tools`). Only
the functions that need verifiers import it (and `harness`, a `vf.Harness` subclass, which only they import), so
trace-rl without it still imports."""
