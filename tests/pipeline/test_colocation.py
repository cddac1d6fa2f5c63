"""Which engines a run starts and how they share the GPU, decided from real configs (on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trace_rl.config import ConfigError
from trace_rl.pipeline import colocation
from trace_rl.pipeline.colocation import runtime_configs
from trace_rl.runs.loading import load_config, validate_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def example(name: str, *overrides: str):
    return load_config(CONFIGS / f"{name}.toml", ["inference.backend=vllm", *overrides])


@pytest.mark.parametrize(("name", "engines"), [
    ("demo", ["policy"]),
    ("opd", ["policy", "reference"]),  # the policy samples, the reference scores every token
    ("sft-distill", ["reference"]),  # actor = reference, sft scores nothing: no policy engine
    ("grpo-echo", ["policy"]),
])
def test_engines_exist_only_for_the_models_something_uses(name, engines):
    assert colocation.engines(example(name)) == engines


def test_opsd_scores_with_the_policy_itself():
    config = example("opd", "algorithms=[{id = 'opsd'}]")
    assert colocation.models_in_use(config) == ["policy"] and colocation.engines(config) == ["policy"]


def test_servers_and_the_hf_sampler_start_no_vllm_engine():
    assert colocation.engines(example("opd", "inference.backend=hf")) == []
    served = example("opd", "inference.base_url='http://127.0.0.1:1'", "models.reference.base_url='http://x:2'")
    assert colocation.models_in_use(served) == ["policy", "reference"] and colocation.engines(served) == []
    assert colocation.engines(example("opd", "models.reference.base_url='http://x:2'")) == ["policy"]


def test_the_memory_budget_is_split_among_the_engines_that_exist():
    assert colocation.memory_shares(example("opd", "inference.gpu_memory_utilization=0.8")) == {
        "policy": 0.4, "reference": 0.4}
    assert colocation.memory_shares(example("sft-distill", "inference.gpu_memory_utilization=0.8")) == {
        "reference": 0.8}
    configs = runtime_configs(example("opd", "inference.gpu_memory_utilization=0.8"), cuda_available=True)
    assert (configs["policy"].gpu_memory_utilization, configs["reference"].gpu_memory_utilization) == (0.4, 0.4)
    assert configs["policy"].sleep_mode and configs["reference"].sleep_mode


def test_colocation_is_the_default_when_the_trainer_is_on_cuda():
    config = example("opd")
    assert colocation.colocated(config, cuda_available=True)
    assert not colocation.colocated(config, cuda_available=False)  # CPU: no sleep mode
    assert not colocation.colocated(example("opd", "inference.colocate=false"), cuda_available=True)
    assert not colocation.colocated(example("opd", "trainer.device='cpu'"), cuda_available=True)
    assert colocation.colocated(example("opd", "trainer.device='cuda'"), cuda_available=False)
    assert not colocation.colocated(example("opd", "inference.backend=hf"), cuda_available=True)
    # engines that sample ahead while the trainer runs cannot sleep for it
    assert not colocation.colocated(example("opd", "async.max_off_policy_steps=1"), cuda_available=True)
    assert not any(c.sleep_mode for c in runtime_configs(config, cuda_available=False).values())


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.device='cpu'"], "inference.colocate = true: trainer.device = 'cpu' shares no GPU"),
    (["inference.backend=hf"], "inference.colocate = true: no model runs on an in-process vLLM engine"),
    (["async.max_off_policy_steps=1"], "inference.colocate = true with async.max_off_policy_steps = 1: the engines "
                                       "sample the next steps while the trainer runs"),
])
def test_colocate_true_with_nothing_to_colocate_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        example("opd", "inference.colocate=true", *overrides)


def test_a_step_with_the_reference_as_actor_never_builds_nor_reloads_a_policy(tiny_model_path, tmp_path):
    """sft-distill on the hf sampler, one whole step (broadcast included): the policy runtime is never built."""
    from trace_rl.names import POLICY
    from trace_rl.pipeline.session import Session
    from trace_rl.pipeline.step import run_step

    config = validate_config({
        "name": "distill", "steps": 1, "storage": str(tmp_path), "actor": "reference", "algorithms": ["sft"],
        "model": {"name": tiny_model_path}, "models": {"reference": {"name": "tiny:1", "tokens": True}},
        "inference": {"backend": "hf", "max_model_len": 512}, "sampling": {"max_completion_tokens": 4},
        "env": [{"id": "reverse-text", "batch_size": 2, "group_size": 2}],
        "trainer": {"device": "cpu", "micro_batch_tokens": 512},
    })
    session = Session(config)
    assert not session.uses_policy
    result = run_step(session, 1)
    assert result["train"]["metrics"]["tokens/ce"] > 0
    assert session.runtimes.is_built("reference") and not session.runtimes.is_built(POLICY)
    assert session.storage.is_stable(session.storage.path("weights", "000001"))


def test_colocate_true_with_an_auto_trainer_is_refused_where_the_run_starts_without_a_gpu(monkeypatch):
    """`trainer.device = 'auto'` trains on the CPU of a machine without a GPU: refused where the run starts
    (`trace-rl train`, `serve`, `prepare_run`), not when a run's config is read back (export, eval, replay)."""
    monkeypatch.setattr(colocation, "gpu_here", lambda: False)
    with pytest.raises(ConfigError, match="inference.colocate = true: trainer.device = 'auto' trains on the CPU here"):
        load_config(CONFIGS / "opd.toml", ["inference.backend=vllm", "inference.colocate=true"], on_this_machine=True)
    assert example("opd", "inference.colocate=true").inference.colocate  # read back elsewhere: kept
    monkeypatch.setattr(colocation, "gpu_here", lambda: True)
    load_config(CONFIGS / "opd.toml", ["inference.backend=vllm", "inference.colocate=true"], on_this_machine=True)


def test_gpu_here_is_told_without_importing_torch(monkeypatch, tmp_path):
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in `--dry-run`
    monkeypatch.setattr(colocation, "GPU_DEVICES", (str(tmp_path / "nvidiactl"),))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not colocation.gpu_here()
    (tmp_path / "nvidiactl").touch()
    assert colocation.gpu_here()
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not colocation.gpu_here()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert colocation.gpu_here()
    assert "torch" not in sys.modules
