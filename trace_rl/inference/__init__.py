"""Samplers (model runtimes over transformers, an in-process vLLM engine, or a vLLM server) and weight broadcast."""
