"""Each builtin environment through the real samplers (hf and vLLM on the tiny model), plus scripted
episodes that steer the tool environment through valid, failing and malformed calls."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.envs.conftest import ScriptedRuntime
from trace_rl.config import SamplingConfig
from trace_rl.data.trace import Trace
from trace_rl.envs import EnvError, Environment, Sampler, load_env, resolve_env_class
from trace_rl.envs.alphabet_sort import answer_lines
from trace_rl.envs.similarity import similarity
from trace_rl.models.render import Renderer
from trace_rl.models.tiny import build_tokenizer

SAMPLING = SamplingConfig(temperature=0.9, max_completion_tokens=12)


def rollout(env: Environment, runtime, seed: int = 0, index: int = 0) -> list[Trace]:
    example = env.examples(seed, index + 1)[index]
    return asyncio.run(env.rollout(example, Sampler(runtime, SAMPLING, seed=seed)))


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def check_token_exact(trace: Trace, tokenizer, tools=None) -> None:
    """Valid per-token arrays; the one branch decodes to the rendered conversation; sampled tokens belong
    to assistant messages; unsampled message tokens are what the template rendered for that message."""
    assert trace.error is None and len(trace.branches) == 1  # ChatML never rewrites history
    [branch] = trace.branches
    assert branch.temperature == SAMPLING.temperature
    rendered = Renderer(tokenizer, tools).text(trace.messages, add_generation_prompt=False)
    text = decode(tokenizer, branch.token_ids)
    assert rendered.startswith(text) and rendered[len(text):] in ("\n", "<|im_end|>\n")
    roles = np.array([m.role for m in trace.messages])[branch.message_index[branch.sampled]]
    assert set(roles) == {"assistant"}
    assert np.all(np.isfinite(branch.logprobs)) and np.all(branch.logprobs[branch.sampled] <= 0)
    assert np.all(branch.logprobs[~branch.sampled] == 0)
    for k, message in enumerate(trace.messages):
        if message.role != "assistant":
            content = (branch.message_index == k) & branch.is_content
            assert decode(tokenizer, branch.token_ids[content]) == message.content


def test_reverse_text(runtime):
    env = load_env("reverse-text", {"min_length": 3, "max_length": 5})
    [trace] = rollout(env, runtime)
    check_token_exact(trace, runtime.tokenizer)
    [user, reply] = trace.messages
    text = user.content.removeprefix("reverse: ")
    assert 3 <= len(text) <= 5 and trace.info["answer"] == text[::-1]
    assert trace.reward == pytest.approx(similarity(reply.content.strip(), text[::-1]))
    assert 0.0 <= trace.reward <= 1.0 and trace.rewards == {"similarity": trace.reward}


def test_alphabet_sort_is_multi_turn_with_user_feedback(runtime):
    env = load_env("alphabet-sort", {"turns": 3, "first_names": 2, "added_names": 1})
    [trace] = rollout(env, runtime)
    check_token_exact(trace, runtime.tokenizer)
    assert [m.role for m in trace.messages] == ["user", "assistant"] * 3
    feedback = trace.messages[2].content
    assert feedback.startswith("Your list was") and "sort the whole list again" in feedback
    names = [line for m in trace.messages[::2] for line in m.content.splitlines()[1:]]
    assert len(names) == 4 and trace.info["answer"] == "\n".join(sorted(names))
    turns = [similarity(answer_lines(trace.messages[i].content), sorted(names[: 2 + i // 2])) for i in (1, 3, 5)]
    assert trace.rewards == pytest.approx({"turn_1": turns[0], "turn_2": turns[1], "turn_3": turns[2]})
    assert trace.reward == pytest.approx(sum(turns) / 3)
    assert trace.metrics["turns"] == 3


def test_link_nav_tool_messages_carry_tool_names(runtime):
    env = load_env("link-nav")
    [trace] = rollout(env, runtime)
    check_token_exact(trace, runtime.tokenizer)
    opening = trace.messages[3]
    assert opening.role == "tool" and opening.name == "click_link" and opening.content.startswith("Page: ")
    [branch] = trace.branches
    tool_tokens = branch.token_ids[(branch.message_index == 3) & branch.is_content]
    assert decode(runtime.tokenizer, tool_tokens) == opening.content
    assert all(m.name for m in trace.messages if m.role == "tool")
    _, _, start, _, target = trace.messages[1].content.rstrip(".").split()
    assert trace.info["answer"] == target and trace.info["path"][0] == start
    assert 0.0 <= trace.reward <= 1.0


def test_number_debate_gives_one_trace_per_seat(runtime):
    traces = rollout(load_env("number-debate", {"rounds": 2}), runtime)
    assert [t.agent for t in traces] == ["player_a", "player_b"]
    assert [t.trainable for t in traces] == [True, False]
    for trace in traces:
        check_token_exact(trace, runtime.tokenizer)
        assert sum(m.role == "assistant" for m in trace.messages) == 2
    a, b = traces
    # each player hears the other's latest reply as a user message
    assert b.messages[2].content == f"player_a says: {a.messages[2].content}"
    assert a.messages[3].content == f"player_b says: {b.messages[3].content}"
    assert b.messages[4].content == f"player_a says: {a.messages[4].content}"
    assert sorted([a.reward, b.reward]) in ([0.5, 0.5], [0.0, 1.0])
    flipped = rollout(load_env("number-debate", {"learner": "player_b"}), runtime)
    assert [t.trainable for t in flipped] == [False, True]


def test_same_seed_same_traces(hf_runtime):
    env = load_env("alphabet-sort")
    first, second = rollout(env, hf_runtime, seed=3), rollout(env, hf_runtime, seed=3)
    assert first[0].equals(second[0])
    other = rollout(env, hf_runtime, seed=4)
    assert not np.array_equal(other[0].branches[0].token_ids, first[0].branches[0].token_ids)
    assert env.examples(7, 3) == env.examples(7, 3) and env.examples(7, 3) != env.examples(8, 3)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_link_nav_scripted_episode_reaches_the_target(tokenizer):
    env = load_env("link-nav", {"pages": 5, "max_turns": 6})
    example = env.examples(0, 1)[0]
    links, start, target = example.data["links"], example.data["start"], example.data["target"]
    wrong = next(p for p in links if p not in links[start] and p != start)
    first_hop = next(p for p in links[start] if p != target)
    replies = [
        '<tool_call>click_link {"page": "' + wrong + '"}</tool_call>',  # not linked from here
        "<tool_call>jump {}</tool_call>",                                 # unknown tool
        '<tool_call>click_link {"page": </tool_call>',                   # malformed JSON
        '<tool_call>click_link {"page": "' + first_hop + '"}</tool_call>',
        "<tool_call>go_back {}</tool_call>",
        "I am done.",
    ]
    trace = asyncio.run(env.rollout(example, Sampler(ScriptedRuntime(tokenizer, replies), SAMPLING, seed=0)))[0]
    check_token_exact(trace, tokenizer)
    tools = [m for m in trace.messages if m.role == "tool"][1:]
    assert [m.name for m in tools] == ["click_link", "jump", "click_link", "click_link", "go_back"]
    assert tools[0].content.startswith(f"error: no link to '{wrong}' on {start}")
    assert tools[1].content.startswith("error: unknown tool 'jump'")
    assert tools[2].content.startswith("error: arguments of click_link are not valid JSON")
    assert tools[3].content.startswith(f"Page: {first_hop}.") and tools[4].content.startswith(f"Page: {start}.")
    assert trace.info["path"] == [start, first_hop, start]
    assert trace.metrics["tool_calls"] == 4 and trace.metrics["invalid_calls"] == 3
    # the malformed reply stays plain text; the valid ones become tool calls joined to their results
    assert trace.messages[8].tool_calls is None and trace.messages[10].tool_calls[0].name == "click_link"
    assert tools[3].tool_call_id == trace.messages[10].tool_calls[0].id
    assert trace.reward == 0.0 and trace.rewards["reached"] == 0.0


def test_link_nav_reward_is_progress_toward_target(tokenizer):
    from trace_rl.envs.link_nav import distances

    env = load_env("link-nav", {"pages": 6})
    example = next(e for e in env.examples(1, 20) if distances(e.data["links"], e.data["target"])[e.data["start"]] >= 2)
    links, start, target = example.data["links"], example.data["start"], example.data["target"]
    to_target = distances(links, target)
    step = min(links[start], key=lambda p: to_target[p])
    reply = '<tool_call>click_link {"page": "' + step + '"}</tool_call>'
    runtime = ScriptedRuntime(tokenizer, [reply, "stop"])
    [trace] = asyncio.run(env.rollout(example, Sampler(runtime, SAMPLING, seed=0)))
    assert trace.reward == pytest.approx((to_target[start] - to_target[step]) / to_target[start])


def test_secret_lookup_scripted_episodes_score_the_looked_up_number(tokenizer):
    env = load_env("secret-lookup", {"max_turns": 3})
    example = env.examples(0, 1)[0]
    word, secret = example.data["word"], str(example.data["secrets"][example.data["word"]])
    other = next(w for w in example.data["secrets"] if w != word)

    def play(*replies):
        runtime = ScriptedRuntime(tokenizer, list(replies))
        return asyncio.run(env.rollout(example, Sampler(runtime, SAMPLING, seed=0)))[0]

    call = '<tool_call>lookup {"word": "' + word + '"}</tool_call>'
    trace = play("<tool_call>search {}</tool_call>", call, f"It is {secret}.")
    check_token_exact(trace, tokenizer)
    assert trace.messages[2].content.startswith("<tool_call>lookup") and trace.messages[2].content.count(other) == 1
    tools = [m for m in trace.messages if m.role == "tool"][1:]  # after the scripted demonstration
    assert [m.content for m in tools] == ["error: unknown tool 'search'; use lookup",
                                          f"The secret number of {word} is {secret}."]
    assert trace.reward == 1.0 and trace.metrics["lookup_success"] == 1.0
    assert (trace.metrics["tool_calls"], trace.metrics["invalid_calls"]) == (2, 1)
    wrong_word = play('<tool_call>lookup {"word": "' + other + '"}</tool_call>', f"It is {secret}.")
    assert wrong_word.metrics["lookup_success"] == 0.0 and wrong_word.reward == 1.0  # right answer, wrong lookup
    guessed = play("It is 123.")
    assert (guessed.reward, guessed.metrics["lookup_success"], guessed.metrics["tool_calls"]) == (
        float(secret == "123"), 0.0, 0)


def test_registry_and_args_errors():
    assert resolve_env_class("reverse-text").id == "reverse-text"
    assert resolve_env_class("trace_rl.envs.reverse_text:ReverseText") is resolve_env_class("reverse-text")
    with pytest.raises(EnvError, match="unknown env id 'nope'.*alphabet-sort"):
        resolve_env_class("nope")
    with pytest.raises(EnvError, match="module .no_such_module. was not found on sys.path"):
        resolve_env_class("no_such_module:Env")
    with pytest.raises(EnvError, match="not a trace_rl Environment"):
        resolve_env_class("trace_rl.data.trace:Trace")
    with pytest.raises(EnvError, match=r"args.max_lenght: unknown key \(known keys: min_length, max_length"):
        load_env("reverse-text", {"max_lenght": 3})
    with pytest.raises(EnvError, match="min_length 5 > max_length 3"):
        load_env("reverse-text", {"min_length": 5, "max_length": 3})
    with pytest.raises(EnvError, match="links_per_page 5 must be below pages 5"):
        load_env("link-nav", {"pages": 5, "links_per_page": 5})
