"""Hand-built, message-attributed traces for algorithm tests."""

from __future__ import annotations

import asyncio

import numpy as np

from trace_rl.data.trace import Branch, Message, Trace


def chat_branch(layout, index=0, temperature=1.0, logprob=-0.5):
    """A branch rendered like ChatML from `layout`: (message_index, content_tokens, sampled) per message.

    An observation renders as a header token (scaffold), its content, an end token (scaffold).
    A sampled message renders as a generation-prompt header (message_index -1, not sampled),
    then its content and end token, both sampled with logprob `logprob`.
    """
    message_index, sampled, is_content = [], [], []
    for message, tokens, was_sampled in layout:
        message_index += [-1 if was_sampled else message] + [message] * (tokens + 1)
        sampled += [False] + [was_sampled] * (tokens + 1)
        is_content += [False] + [True] * tokens + [False]
    n = len(message_index)
    sampled = np.array(sampled)
    return Branch(
        token_ids=np.arange(n) + 10, sampled=sampled, logprobs=np.where(sampled, logprob, 0.0),
        message_index=message_index, is_content=is_content, index=index, temperature=temperature,
    )


def make_trace(trace_id, messages, branches, group="g0", **kw):
    return Trace(id=trace_id, env="toy", example_id="e0", group_id=group,
                 messages=[Message(**m) for m in messages], branches=branches, **kw)


def reward_trace(trace_id, reward, group="g0", **kw):
    """A single-turn trace: user prompt (2 tokens) then a sampled answer (2 tokens): 8 tokens, 3 sampled."""
    return make_trace(trace_id, [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}],
                      [chat_branch([(0, 2, False), (1, 2, True)])], group=group, reward=reward, **kw)


def run(coroutine):
    return asyncio.run(coroutine)
