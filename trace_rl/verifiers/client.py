"""verifiers' model client on trace-rl's sampler: each turn of a verifiers episode is rendered with the model's chat
template and sampled by the run's own runtime (in-process vLLM, hf, a vLLM server), token for token.

verifiers (0.4.0, pinned) builds a rollout's client inside its interception server from the rollout's client
config (`verifiers.v1.interception.server.resolve_client`); a `vf.Client` instance cannot be handed over.
`install()` wraps that one function: a `TrainClientConfig` carrying the `SAMPLER_HEADER` header gets a
`SamplerClient` on the sampler registered under the header's value (`register`); every other config is built by
verifiers as before. The config stays plain verifiers data, so the trace records it as a train client.

Token-exact turns: the first turn (and any turn whose history the template re-renders differently) renders the
whole prompt; a later turn takes the earlier turns' exact ids from the trace (`PendingTurn`'s bridge anchor: the
previous prompt and sampled completion) and appends only the footer of the sampled turn, the new messages and the
generation prompt (`trace_rl.models.render.Renderer.extend`), so no sampled token is ever re-tokenized. Each
message's token span and the per-token content mask go back to verifiers with the sampled ids and logprobs.

Tool calls: a sampled turn's `<tool_call>` blocks (`trace_rl.models.tool_calls`) go back to verifiers as the
assistant message's `tool_calls`, the text before them as its content; the sampled ids stay the turn's tokens, so
what is trained is what was sampled. The tools of the turn reach the prompt through `Renderer` (the template's
rendering, or trace-rl's system-turn block for a template that ignores them).

A harness's `GET /v1/models` (verifiers relays it to the client's base URL, which a sampler in this process does not
have) is answered by the interception server itself: the rollout's model id and its `max_model_len`, as vLLM's own
listing gives them, so a harness sizes its context (the `bash` harness's compaction) to the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from trace_rl.data.trace import Message, ToolCall
from trace_rl.errors import FatalError
from trace_rl.models.render import Rendered, Renderer
from trace_rl.models.runtime import Generation
from trace_rl.models.tool_calls import parse_tool_calls
from trace_rl.verifiers.convert import call_arguments

SAMPLER_HEADER = "X-Trace-RL-Sampler"
SAMPLER_URL = "http://trace-rl.sampler.invalid/v1"  # never called: the sampler samples in this process


class TurnSampler(Protocol):
    """What a rollout's verifiers turns sample with (the env builds it on `trace_rl.envs.base.Sampler`): the
    model's tokenizer, end-of-turn token, id and context length, the rollout's first error, and `generate` of one
    turn of the `conversation`-th trace that asks (each conversation and turn its own seed)."""

    tokenizer: Any
    end_of_turn: str | None
    model: str
    max_model_len: int
    error: BaseException | None  # the rollout's first error, which it raises as itself once the episode ended

    async def generate(self, prompt_ids: list[int], *, conversation: int, turn: int) -> Generation: ...


SAMPLERS: dict[str, TurnSampler] = {}


def register_sampler(key: str, sampler: TurnSampler) -> None:
    SAMPLERS[key] = sampler


def unregister_sampler(key: str) -> None:
    SAMPLERS.pop(key, None)


def client_config(key: str):
    """The verifiers client config of the sampler registered under `key`."""
    import verifiers.v1 as vf

    return vf.TrainClientConfig(base_url=SAMPLER_URL, api_key_var="TRACE_RL_SAMPLER_KEY",
                                headers={SAMPLER_HEADER: key})


def model_listing(sampler: TurnSampler) -> dict:
    """`GET /v1/models` of a sampler, shaped as vLLM's."""
    return {"object": "list", "data": [{"id": sampler.model, "object": "model", "created": 0, "owned_by": "trace-rl",
                                        "root": sampler.model, "max_model_len": sampler.max_model_len}]}


def install() -> None:
    """Route client configs carrying `SAMPLER_HEADER` to `SamplerClient`, and answer their `GET /v1/models`
    (idempotent)."""
    from aiohttp import web
    from verifiers.v1.interception import server
    from verifiers.v1.dialects import DIALECTS

    original = server.resolve_client
    if getattr(original, "trace_rl_sampler", False):
        return

    def resolve_client(config):
        key = getattr(config, "headers", {}).get(SAMPLER_HEADER)
        return original(config) if key is None else SamplerClient(key)

    relay = server.InterceptionServer.handle_models

    async def handle_models(self, request):
        for dialect in DIALECTS:
            session = self.sessions.get(dialect.secret(request.headers))
            if session is not None:
                key = getattr(session.ctx.client, "headers", {}).get(SAMPLER_HEADER)
                if key is not None and key in SAMPLERS:
                    return web.json_response(model_listing(SAMPLERS[key]))
                break
        return await relay(self, request)

    resolve_client.trace_rl_sampler = True
    server.resolve_client = resolve_client
    server.InterceptionServer.handle_models = handle_models


class ImagesRefused(FatalError):
    """A message of the episode carries an image: trace-rl's models read text only, and verifiers' `content_text`
    would drop the image without a word (a vision env would score replies to an image the model never saw)."""


def images_problem(messages: Any) -> str | None:
    """Why a text-only model cannot take these verifiers messages (one carries an image), or None."""
    from verifiers.v1.types import ImageUrlContentPart

    for message in messages or ():
        content = getattr(message, "content", None)
        if isinstance(content, list) and any(isinstance(part, ImageUrlContentPart) for part in content):
            return (f"a {message.role} message carries an image, and trace-rl trains text-only models (the image "
                    "would be dropped unseen); use a taskset whose messages are text")
    return None


def to_message(message: Any) -> Message:
    """A verifiers message as trace-rl's (text content; tool calls with their JSON arguments parsed); an image is
    refused (`ImagesRefused`)."""
    from verifiers.v1.types import content_text

    problem = images_problem([message])
    if problem is not None:
        raise ImagesRefused(f"env 'verifiers': {problem}")
    calls = None
    if getattr(message, "tool_calls", None):
        calls = [ToolCall(id=c.id, name=c.name, arguments=call_arguments(c.arguments or "{}"))
                 for c in message.tool_calls]
    return Message(role=message.role, content=content_text(message.content) if message.content else "",
                   tool_call_id=getattr(message, "tool_call_id", None), name=getattr(message, "name", None),
                   tool_calls=calls)


def assistant_message(text: str, call_prefix: str):
    """A sampled turn as verifiers' assistant message: its tool calls (`trace_rl.models.tool_calls`, ids
    `<call_prefix>-<i>`) with the text before them as content; a turn with a malformed call is all content."""
    from verifiers.v1.types import AssistantMessage
    from verifiers.v1.types import ToolCall as VfToolCall

    parsed = parse_tool_calls(text, call_prefix).message
    calls = [VfToolCall(id=call.id, name=call.name, arguments=json.dumps(call.arguments))
             for call in parsed.tool_calls or ()]
    return AssistantMessage(content=parsed.content, tool_calls=calls or None)


def message_spans(message_index: np.ndarray, count: int, offset: int = 0, first: int = 0) -> list:
    """Per message of `count`: the (start, end) of the tokens it owns, shifted by `offset`, or None (the messages
    before `first` and those the template does not show)."""
    spans: list[tuple[int, int] | None] = [None] * count
    for k in range(first, count):
        owned = np.flatnonzero(message_index == k)
        if owned.size:
            spans[k] = (offset + int(owned[0]), offset + int(owned[-1]) + 1)
    return spans


class SamplerClient:
    """A `vf.Client` (duck-typed: verifiers calls `get_response` and `close`) on one registered sampler.

    One client serves one rollout (its config names the rollout's sampler); the agents of an episode share it,
    each trace its own conversation (numbered in the order their first turns arrive).
    """

    def __init__(self, key: str):
        self.key = key
        self.turns: dict[str, list[int]] = {}  # trace id -> [its conversation number, its turns so far]

    @property
    def sampler(self) -> TurnSampler:
        try:
            return SAMPLERS[self.key]
        except KeyError:
            raise RuntimeError(f"no trace-rl sampler {self.key!r} is registered (its rollout ended)") from None

    def renderer(self, tools: list[dict] | None) -> Renderer:
        return Renderer(self.sampler.tokenizer, tools, end_of_turn=self.sampler.end_of_turn,
                        describe_ignored_tools=True)

    async def get_response(self, dialect, body: dict, sampling, session_id: str | None = None, turn=None,
                           headers: Mapping[str, str] | None = None):
        from verifiers.v1.clients.train import serialize_completion, tool_to_wire
        from verifiers.v1.types import Response, TurnTokens, Usage

        if turn is None:
            raise RuntimeError("verifiers sent a turn without its graph prefix; trace-rl needs verifiers 0.4.0")
        sampler = self.sampler
        renderer = self.renderer([tool_to_wire(tool) for tool in turn.tools] or None)
        try:
            messages = [to_message(m) for m in turn.prompt]
        except ImagesRefused as exc:  # fails the run, not just this episode: every episode would drop its images
            sampler.error = sampler.error or exc
            raise
        prompt_ids, spans, is_content, bridged = self.prompt(renderer, turn, messages)
        counts = self.turns.setdefault(session_id or "", [len(self.turns), 0])
        conversation, turns = counts
        counts[1] += 1
        generation = await sampler.generate(prompt_ids, conversation=conversation, turn=turns)
        ids = list(generation.token_ids)
        ended = bool(ids) and ids[-1] == renderer.end_of_turn_id
        text = renderer.tokenizer.decode(ids[: len(ids) - ended], skip_special_tokens=False)
        model = body.get("model", "")
        response = Response(
            id=f"trace-rl-{session_id}-{turns}", created=0, model=model,
            message=assistant_message(text, f"call-{conversation}-{turns}"),
            finish_reason="stop" if generation.finish_reason == "stop" else "length",
            usage=Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(ids)),
            tokens=TurnTokens(prompt_ids=prompt_ids, completion_ids=ids,
                              completion_logprobs=[float(x) for x in generation.logprobs],
                              message_spans=spans, is_content=is_content, bridged=bridged),
        )
        response.raw = serialize_completion(response, model)
        return response

    def prompt(self, renderer: Renderer, turn, messages: list[Message]) -> tuple[list[int], list, list[bool], bool]:
        """The turn's prompt ids, each message's span, the per-token content mask, and whether it extends the
        earlier turns' exact ids."""
        previous = turn.previous_renderer_token_ids() if turn.tail and turn.tail[-1].role in ("user", "tool") else None
        if previous is not None:
            earlier_prompt, earlier_completion = previous
            ended = earlier_completion[-1] == renderer.end_of_turn_id
            extension: Rendered | None = renderer.extend(messages, turn.tail_start, ended)
            if extension is not None:
                earlier = [*earlier_prompt, *earlier_completion]
                spans = message_spans(extension.message_index, len(messages), len(earlier), turn.tail_start)
                return ([*earlier, *extension.token_ids.tolist()], spans,
                        [False] * len(earlier) + extension.is_content.tolist(), True)
        rendered = renderer.render(messages, add_generation_prompt=True)
        return (rendered.token_ids.tolist(), message_spans(rendered.message_index, len(messages)),
                rendered.is_content.tolist(), False)

    async def close(self) -> None:
        pass
