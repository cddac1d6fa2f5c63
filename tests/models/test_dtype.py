"""`model.dtype = "auto"`: bfloat16 on CUDA and on CPUs that compute it faster, float32 elsewhere, per side: the
samplers stay float32 on an AVX512-BF16 CPU without AMX, where `make demo` learned less with bfloat16 samplers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trace_rl.models import dtype
from trace_rl.models.dtype import choose_dtype, cpu_flags, resolved_dtype
from trace_rl.pipeline.colocation import runtime_configs
from trace_rl.runs.loading import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# /proc/cpuinfo flags (abridged) of the machines trace-rl meets
XEON_AMX = "fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"  # Sapphire Rapids
ZEN4 = "fpu sse2 avx2 avx512f avx512_bf16"  # AVX512-BF16 without AMX
EPYC_AVX2 = "fpu sse2 avx2 fma f16c"  # this project's AVX2-only machine
ARM = "fp asimd evtstrm aes pmull sha1 sha2 crc32"


@pytest.mark.parametrize(("flags", "cuda", "trainer", "sampler", "why"), [
    (EPYC_AVX2, True, "bfloat16", "bfloat16", "the trainer runs on CUDA"),
    (XEON_AMX, False, "bfloat16", "bfloat16", "amx_bf16, avx512_bf16"),
    (ZEN4, False, "bfloat16", "float32", "avx512_bf16"),
    (EPYC_AVX2, False, "float32", "float32", "none of amx_bf16, avx512_bf16"),
    (ARM, False, "float32", "float32", "bfloat16 would be emulated"),
    ("", False, "float32", "float32", "no CUDA"),
])
def test_auto_chooses_by_side_the_trainer_device_and_the_cpu_flags(flags, cuda, trainer, sampler, why):
    for side, expected in (("trainer", trainer), ("sampler", sampler)):
        chosen, reason = choose_dtype(cuda, frozenset(flags.split()), side)
        assert chosen == expected and why in reason
    if (trainer, sampler) == ("bfloat16", "float32"):
        assert "learned less with bfloat16 samplers" in choose_dtype(cuda, frozenset(flags.split()), "sampler")[1]
    with pytest.raises(ValueError, match="side"):
        choose_dtype(cuda, frozenset(flags.split()), "engine")


def test_the_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: {XEON_AMX}\n\nprocessor\t: 1\n")
    assert cpu_flags(str(cpuinfo)) == frozenset(XEON_AMX.split())
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_an_explicit_dtype_stays_and_auto_is_logged_once_per_side(monkeypatch, caplog):
    monkeypatch.setattr(dtype, "cpu_flags", lambda: frozenset(ZEN4.split()))
    resolved_dtype.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="trace_rl.models.dtype"):
            assert resolved_dtype("float16", False) == resolved_dtype("float16", False, "sampler") == "float16"
            assert [resolved_dtype("auto", False) for _ in range(3)] == ["bfloat16"] * 3
            assert [resolved_dtype("auto", False, "sampler") for _ in range(3)] == ["float32"] * 3
        assert [r.getMessage() for r in caplog.records] == [
            "model.dtype = 'auto' for the trainer: bfloat16, since the CPU computes bfloat16 (avx512_bf16 in "
            "/proc/cpuinfo)",
            "model.dtype = 'auto' for the sampler: float32, since the CPU has avx512_bf16 but no amx_bf16: `make "
            "demo` learned less with bfloat16 samplers there (bench/RESULTS-bf16.md, run 15)"]
    finally:
        resolved_dtype.cache_clear()


@pytest.mark.parametrize(("cuda", "device"), [(True, "auto"), (False, "auto"), (True, "cpu")])
def test_every_sampler_gets_the_samplers_dtype(cuda, device):
    config = load_config(CONFIGS / "opd.toml", ["model.dtype='auto'", "models.reference.dtype='auto'",
                                                f"trainer.device='{device}'", "inference.colocate=false"])
    expected = "bfloat16" if cuda and device == "auto" else choose_dtype(False, cpu_flags(), "sampler")[0]
    configs = runtime_configs(config, cuda_available=cuda)
    assert configs["policy"].dtype == configs["reference"].dtype == expected


def test_the_trainer_computes_in_the_dtype_auto_chose(tiny_model_path, tmp_path):
    import torch

    from trace_rl.config import Config
    from trace_rl.storage import RunStorage
    from trace_rl.trainer.trainer import Trainer

    config = Config(name="auto", storage=str(tmp_path), env=[{"id": "synthetic"}],
                    model={"name": tiny_model_path, "dtype": "auto"}, trainer={"device": "cpu"})
    trainer = Trainer(config, RunStorage.of(config))
    assert trainer.dtype == getattr(torch, choose_dtype(False, cpu_flags())[0])
    assert trainer.attention == "packed_sdpa"
