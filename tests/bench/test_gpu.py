"""bench/gpu.py end to end at toy size on CPU: both sides run and the report holds their figures."""

from __future__ import annotations

import pytest

from bench import gpu


@pytest.mark.slow
def test_the_gpu_benchmark_runs_at_toy_size_on_cpu(tmp_path):
    out = tmp_path / "RESULTS-gpu.md"
    rollouts, completion_tokens = 8, 4
    result = gpu.main(["--size", "toy", "--dtype", "float32", "--rollouts", str(rollouts), "--completion-tokens",
                       str(completion_tokens), "--steps", "2", "--sampler", "hf", "--trl", "hf",
                       "--micro-batch-tokens", "1024", "--cache", str(tmp_path / "models"), "--out", str(out)])
    assert result["device"] == "CPU (no CUDA)"
    assert 9e6 < result["parameters"] < 11e6  # the realistic fixture: 151,936 x 64 embedding, 2 small layers
    for side in ("trace-rl", "trl"):
        summary = result["sides"][side]["summary"]
        assert summary["steps_measured"] == 1
        assert 0 < summary["completion_tokens_per_step"] <= rollouts * completion_tokens
        assert summary["tokens_per_step"] > summary["completion_tokens_per_step"]
        assert 0 < summary["mfu"] < 1 and summary["sampler_tokens_per_s"] > 0 and summary["step_seconds"] > 0
    stages = result["sides"]["trace-rl"]["summary"]["stages"]
    assert {"sample_rollouts", "train", "trainer/compute", "broadcast_weights"} <= set(stages)
    text = out.read_text()
    assert text.startswith("# GPU benchmark: CPU (no CUDA)") and "| trace-rl |" in text and "| trl |" in text
    assert "trace-rl step time / TRL step time" in text


def test_full_size_refuses_a_machine_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --size full would run the real benchmark")
    with pytest.raises(SystemExit):
        gpu.main(["--size", "full"])


def test_the_full_size_model_is_qwen25_05b_shaped():
    """494M parameters counted from the architecture (the model itself is built only where the benchmark runs)."""
    from trace_rl.models.realistic import QWEN25_05B, VOCAB_SIZE

    a = QWEN25_05B
    head_dim = a["hidden_size"] // a["num_attention_heads"]
    kv = a["num_key_value_heads"] * head_dim
    attention = a["hidden_size"] * (a["hidden_size"] + 2 * kv) + (a["hidden_size"] + 2 * kv) + a["hidden_size"] ** 2
    layer = attention + 3 * a["hidden_size"] * a["intermediate_size"] + 2 * a["hidden_size"]
    total = VOCAB_SIZE * a["hidden_size"] + a["num_hidden_layers"] * layer + a["hidden_size"]
    assert round(total / 1e6) == 494
