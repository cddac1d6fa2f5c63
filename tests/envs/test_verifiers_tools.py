"""Tool episodes of the `verifiers` env: a `vf.Toolset` taskset (tests/envs/verifiers_tasksets/facts_tools, its MCP
server a subprocess verifiers starts per rollout, on loopback) on trace-rl's chat harness, the sampled calls parsed
by trace-rl's client, token-exact across the tool turns."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import torch

from tests.envs.conftest import ScriptedRuntime
from tests.envs.test_verifiers_env import assert_token_exact
from trace_rl.models.runtime import Generation, RuntimeConfig
from trace_rl.sandbox import bwrap_lack

TASKSETS = str(Path(__file__).parent / "verifiers_tasksets")


class ScoredScriptedRuntime(ScriptedRuntime):
    """Scripted replies with the tiny model's own logprobs of each reply given the prompt it was handed (transformers,
    float32, temperature 1): what a sampler that sampled those tokens would have recorded."""

    def __init__(self, model_path: str, tokenizer, replies: list[str]):
        from transformers import AutoModelForCausalLM

        super().__init__(tokenizer, replies)
        self.config = RuntimeConfig(key="policy", name="scripted", max_model_len=2048)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)

    async def generate(self, prompt_ids, **kwargs) -> Generation:
        reply = await super().generate(prompt_ids, **kwargs)
        ids = torch.tensor([[*prompt_ids, *reply.token_ids]])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt_ids) - 1:-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None])[:, 0]
        return Generation(token_ids=reply.token_ids, logprobs=logprobs.tolist(), finish_reason="stop")


@pytest.fixture(scope="module")
def facts_env():
    """The facts_tools env on trace-rl's chat harness, with a tool_timeout of 8 s; loaded once for the module."""
    from trace_rl.envs.lookup import load_env

    agent = {"harness": {"id": "trace-rl-chat", "tool_timeout": 8}, "runtime": {"type": "subprocess"}}
    return load_env("verifiers", {"taskset": {"id": "facts_tools"}, "agent": agent}, [TASKSETS])


def play(env, runtime, task: int):
    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Example, Sampler

    sampler = Sampler(runtime, SamplingConfig(max_completion_tokens=64), seed=0)
    return asyncio.run(env.rollout(Example(id=f"task{task}", data={"task": task}), sampler))


def test_a_toolset_episode_runs_its_calls_and_stays_token_exact(facts_env, tiny_model_path, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    replies = [
        'Looking.<tool_call>{"name": "facts_lookup", "arguments": {"key": "oak"}}</tool_call>',
        '<tool_call>{"name": "facts_nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "facts_wait", "arguments": {"seconds": 60}}</tool_call>',
        '<tool_call>{"name": "facts_crash", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "facts_lookup", "arguments": {"key": "tin"}}</tool_call>',
        'It is a tree with acorns.<tool_call>{"name": "facts_lookup", "arguments": {oops}}</tool_call>',  # malformed
    ]
    runtime = ScoredScriptedRuntime(tiny_model_path, tokenizer, replies)
    with caplog.at_level("WARNING", logger="trace_rl.models.tool_schemas"):
        (trace,) = play(facts_env, runtime, task=0)
    assert trace.error is None and trace.reward == 1.0  # the last reply holds the fact
    assert [m.role for m in trace.messages] == ["user", *["assistant", "tool"] * 5, "assistant"]
    calls = [m.tool_calls for m in trace.messages if m.role == "assistant"]
    assert [[(c.name, c.arguments) for c in turn] for turn in calls[:5]] == [
        [("facts_lookup", {"key": "oak"})], [("facts_nope", {})], [("facts_wait", {"seconds": 60})],
        [("facts_crash", {})], [("facts_lookup", {"key": "tin"})]]
    assert trace.messages[1].content == "Looking."  # the text before the call
    assert calls[5] is None and trace.messages[-1].content == replies[-1]  # a malformed call stays text
    results = [m.content for m in trace.messages if m.role == "tool"]
    assert results[0] == "a tree with acorns"
    assert results[1].startswith("error: unknown tool 'facts_nope' (the tools are: facts_crash, facts_lookup")
    assert results[2] == "error: tool facts_wait did not answer within 8 s"
    # its server died answering; then it is gone (refused by the relay to it, or by the relay's listener as it closes)
    assert results[3].startswith("error: tool facts_crash failed: ") and results[4].startswith("error: tool "
                                                                                               "facts_lookup failed: ")
    # the template ignores tools: they are in the system turn, said once in the log
    assert '"name": "facts_lookup"' in tokenizer.decode(runtime.prompts[0]) and "<tools>" in tokenizer.decode(
        runtime.prompts[0])
    assert sum("ignores `tools`" in r.getMessage() for r in caplog.records) <= 1
    # token-exact: one branch; each prompt is the branch so far, the sampled ids are the scripted replies' ids
    (branch,) = trace.branches
    assert_token_exact(branch, runtime.prompts, replies, tokenizer, tiny_model_path)
    assert int(branch.sampled.sum()) == sum(len(tokenizer.encode(r, add_special_tokens=False)) + 1 for r in replies)


def test_a_tool_result_longer_than_the_context_is_a_failed_rollout_with_the_samplers_error(facts_env,
                                                                                             tiny_model_path):
    from transformers import AutoTokenizer

    from trace_rl.config import SamplingConfig
    from trace_rl.envs.base import Example, Sampler
    from trace_rl.pipeline.rollouts import run_rollout

    runtime = ScriptedRuntime(AutoTokenizer.from_pretrained(tiny_model_path),
                              ['<tool_call>{"name": "facts_lookup", "arguments": {"key": "everything"}}</tool_call>'])
    runtime.config = RuntimeConfig(key="policy", name="scripted", max_model_len=2048)
    sampler = Sampler(runtime, SamplingConfig(max_completion_tokens=64), seed=0)
    example = Example(id="task1", data={"task": 1})
    (trace,), _ = asyncio.run(run_rollout(facts_env, example, sampler, max_retries=0, backoff_s=0))
    assert trace.error.startswith("EnvError: verifiers episode of task task1 failed: HarnessError")
    assert "leaves no room under max_model_len 2048" in trace.error and not trace.branches


@pytest.mark.skipif(bwrap_lack() is not None, reason=f"the sandbox needs {bwrap_lack()}")
def test_a_tool_server_reaches_no_loopback_port_unless_its_env_says_so(facts_env, tiny_model_path):
    """A tool server runs sandboxed with its own network: the harness reaches it, it reaches nothing on the host's
    loopback (a listener stands for the Prefect API); `[env.args] tools_network = "host"` gives it the host's."""
    from transformers import AutoTokenizer

    from trace_rl.envs.lookup import load_env

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def reached(env) -> str:
            runtime = ScriptedRuntime(AutoTokenizer.from_pretrained(tiny_model_path), [
                f'<tool_call>{{"name": "facts_reach", "arguments": {{"port": {port}}}}}</tool_call>', "done"])
            runtime.config = RuntimeConfig(key="policy", name="scripted", max_model_len=2048)
            (trace,) = play(env, runtime, task=0)
            assert trace.error is None, trace.error
            return trace.messages[2].content

        assert reached(facts_env) == "no: ConnectionRefusedError"
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):
            listener.accept()
        args = {"taskset": {"id": "facts_tools"}, "tools_network": "host",
                "agent": {"harness": {"id": "trace-rl-chat"}, "runtime": {"type": "subprocess"}}}
        assert reached(load_env("verifiers", args, [TASKSETS])) == "yes"
        listener.accept()[0].close()
