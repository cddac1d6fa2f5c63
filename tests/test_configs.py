"""Every shipped config validates, and the table in the README lists each one."""

from pathlib import Path

import pytest

from tests.conftest import VLLM_OVERRIDES
from trace_rl.runs.loading import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_is_valid(path):
    config = load_config(path)
    assert config.name == path.stem or path.stem == "demo"


def test_readme_lists_every_config():
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in CONFIGS if f"configs/{p.name}" not in readme] == []


def test_the_demo_is_grpo_on_reverse_text():
    config = load_config(ROOT / "configs" / "demo.toml")
    assert [a.id for a in config.algorithms] == ["grpo"] and config.env[0].id == "reverse-text"


@pytest.mark.vllm
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_trains_through_every_stage_on_vllm(path, tmp_path, shared_vllm, request):
    """One small step of each config on the session's vLLM engine (a LoRA config on the session's LoRA engine):
    sampling, algorithms, batch, train, broadcast. Sampling with broadcast weights is tests/inference's."""
    import asyncio

    from trace_rl.pipeline.session import Session
    from trace_rl.pipeline.step import run_step
    from trace_rl.tables import read_batch

    overrides = [*VLLM_OVERRIDES, f"storage={tmp_path}", "steps=1", "sampling.max_completion_tokens=6"]
    config = load_config(path, overrides)
    if config.model.name != "tiny":  # configs/math.toml's real model runs in tests/flows/test_gguf_model.py
        config = load_config(path, [*overrides, "model.name=tiny", "model.dtype=float32"])
    for env in config.env:
        env.batch_size, env.group_size = 2, 2
    lora_engine = request.getfixturevalue("vllm_lora_runtime") if config.model.lora is not None else None
    session = Session(config)
    try:
        result = run_step(session, 1)
        assert result["batch"]["samples"] > 0
        assert session.storage.is_stable(session.storage.path("weights", "000001"))
        assert session.runtimes[config.actor].config.backend == "vllm"
        if lora_engine is not None:
            assert session.runtimes[config.actor].worker is lora_engine.worker  # no engine of its own started
    finally:
        if lora_engine is not None:  # the run's adapter out of it again, as the engine's other tests expect
            asyncio.run(session.runtimes[config.actor].load_weights(lora_engine.config.name, 0))
    batch = read_batch(session.storage, 1)
    losses = {algo.id: load_algorithm_loss(algo.id) for algo in config.algorithms}
    for loss in set(losses.values()):
        assert any(getattr(s, f"{loss}_mask").any() for s in batch), f"no {loss} tokens in the batch of {path.name}"


def load_algorithm_loss(algorithm_id: str) -> str:
    from trace_rl.algorithms.lookup import resolve_algorithm_class

    return resolve_algorithm_class(algorithm_id).loss


def test_prefect_yaml_demo_deployment_is_the_demo_config():
    import yaml

    from trace_rl.runs.loading import validate_config

    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    assert deployments["demo"]["entrypoint"] == "flows/train.py:train_flow"
    assert deployments["replay"]["entrypoint"] == "flows/replay.py:replay_flow"
    assert validate_config(deployments["demo"]["parameters"]["config"]) == load_config(ROOT / "configs" / "demo.toml")
    evaluation = deployments["demo-eval"]
    assert evaluation["entrypoint"] == "flows/eval.py:eval_flow" and evaluation["parameters"]["step"] == 30
    assert validate_config(evaluation["parameters"]["config"]).model_dump(exclude={"eval"}) == validate_config(
        deployments["demo"]["parameters"]["config"]).model_dump(exclude={"eval"})


def test_prefect_yaml_declares_the_deployments_serve_serves(monkeypatch):
    """docs/pipeline.md: `prefect.yaml` declares the same deployments as `trace-rl serve` (train, eval, replay),
    and each one's parameters pass its flow's own validation."""
    import yaml
    from prefect.flows import load_flow_from_entrypoint

    import flows.serve

    served = []
    monkeypatch.setattr(flows.serve, "serve", lambda *deployments: served.extend(deployments))
    flows.serve.serve_config(load_config(ROOT / "configs" / "demo.toml"))
    text = (ROOT / "prefect.yaml").read_text()
    declared = yaml.safe_load(text)["deployments"]
    assert len(declared) == 5 and "# Five deployments: the three of `trace-rl serve" in text
    nodes = "flows/node.py:trainer_node_flow"  # node K of a multi-node trainer (docs/scaling.md): no `serve` counterpart
    assert sorted({d["entrypoint"] for d in declared} - {nodes}) == sorted(d.entrypoint for d in served) == [
        "flows/eval.py:eval_flow", "flows/replay.py:replay_flow", "flows/train.py:train_flow"]
    for deployment in declared:
        if deployment.get("parameters"):
            load_flow_from_entrypoint(deployment["entrypoint"]).validate_parameters(deployment["parameters"])


def test_prefect_yaml_two_node_deployments_share_one_config():
    """docs/scaling.md: the trainer-node deployment serves the run of the two-node train deployment (same config)."""
    import yaml

    from trace_rl.runs.loading import validate_config

    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    train, node = deployments["demo-2-nodes"], deployments["demo-2-nodes-1"]
    assert (train["entrypoint"], node["entrypoint"]) == ("flows/train.py:train_flow", "flows/node.py:trainer_node_flow")
    config = validate_config(train["parameters"]["config"])
    assert config.trainer.nnodes == 2 and node["parameters"]["node_rank"] == 1
    assert validate_config(node["parameters"]["config"]) == config
