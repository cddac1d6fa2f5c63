"""verifiers v1 (`import verifiers.v1 as vf`) traces in trace-rl: conversion both ways (`convert`), the records
files of `replay --traces` and `export-traces` (`records`), and the check that the optional package is there
(`extra`). Only the functions that need verifiers import it, so trace-rl without it still imports."""
