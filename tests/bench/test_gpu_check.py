"""bench.gpu_check's CPU mode (tiny model, toy shapes, float32): every check runs and reports what it measured."""

from __future__ import annotations

import pytest

from bench import gpu_check


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_gpu_check_runs_on_cpu(tiny_model_path, tmp_path):
    out = tmp_path / "RESULTS-gpu.md"
    result = gpu_check.main(["--cpu", "--model", tiny_model_path, "--out", str(out)])
    assert result["device"] == "CPU (no CUDA)" and result["dtype"] == "float32"
    # the FlexAttention forward equals one SDPA per segment on each tree (no backward on CPU)
    assert {row["tree"] for row in result["attention"]} == {"branch of a branch", "groups", "sharing nothing"}
    assert all(row["out"] < 1e-5 and "q" not in row and row["ok"] for row in result["attention"])
    # the chunked and the float32 output layer against the full logits, all float32
    assert [row["run"] for row in result["gradients"]] == ["packed_sdpa, float32", "packed_sdpa, float32 head, float32"]
    for gradients in result["gradients"]:
        assert gradients["logprob_max_abs"] < 1e-5 and gradients["grad_cosine"] > 1 - 1e-9
        assert 0 < gradients["grad_relative_norm"] < 1e-5 and gradients["ok"]
    # the clip's norm on CPU: BLAS dot products of pieces, summed in float64
    assert result["gradient_norm"]["relative_error"] < 1e-6 and result["gradient_norm_ok"]
    runs = result["runs"]
    assert list(runs) == ["packed_sdpa", "packed_sdpa, compile on", "packed_sdpa, float32 head", "LoRA (rank 16)",
                          "FSDP2, one rank"]
    assert [run["compiled"] for run in runs.values()] == [False, True, False, False, False]
    assert [run["output_layer"] for run in runs.values()] == ["chunked", "chunked", "float32", "chunked", "chunked"]
    for run in runs.values():
        assert run["attention"] == "packed_sdpa" and run["finite"] and run["micro_batches"] == 2
        # two groups of 8 sharing their prompts: the model computes fewer positions than the samples hold
        assert run["tokens"] == runs["packed_sdpa"]["tokens"] < run["sample_tokens"]
        assert 0 < run["mfu"] < run["mfu_attention"] < 1 and run["tokens_per_s"] > 0 and run["peak_gb"] is None
        assert run["host_seconds"] > 0 and run["gpu_seconds"] is None
    sampler = result["sampler"]
    assert 0 < sampler["completion_tokens"] <= 4 * 8
    assert sampler["chunked"]["gap_max"] < 1e-5 and sampler["float32"]["gap_max"] < 1e-5
    text = out.read_text()
    assert text.startswith("# GPU check: CPU (no CUDA)")
    assert "| branch of a branch | float32 |" in text and "| FSDP2, one rank | packed_sdpa | chunked | no |" in text
    assert "| packed_sdpa, compile on | packed_sdpa | chunked | yes |" in text
    assert "## The clip's gradient norm" in text


def test_the_check_refuses_a_machine_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run for real")
    with pytest.raises(SystemExit):
        gpu_check.main([])


def test_the_full_size_model_is_qwen25_05b_shaped():
    """494M parameters counted from the architecture (the model itself is built only where the check runs)."""
    from trace_rl.models.realistic import QWEN25_05B, VOCAB_SIZE

    a = QWEN25_05B
    head_dim = a["hidden_size"] // a["num_attention_heads"]
    kv = a["num_key_value_heads"] * head_dim
    attention = a["hidden_size"] * (a["hidden_size"] + 2 * kv) + (a["hidden_size"] + 2 * kv) + a["hidden_size"] ** 2
    layer = attention + 3 * a["hidden_size"] * a["intermediate_size"] + 2 * a["hidden_size"]
    total = VOCAB_SIZE * a["hidden_size"] + a["num_hidden_layers"] * layer + a["hidden_size"]
    assert round(total / 1e6) == 494
