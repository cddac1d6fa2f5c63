"""`steps/<step>/episodes.html`: a static page of one step's episodes, for a person to see what the agent did.

`trace-rl view RUN --step N` writes it (and every step of a run with `[prefect.rollouts] count > 0` writes it, linked
from the step's Prefect artifacts). One section per trace, in trace order: env, example, agent, reward (and the
error of a failed rollout); its messages by role, each assistant turn's tool calls (name and JSON arguments) and
each tool result with the call it answers; then each branch's tokens as the model saw them, every token coloured
by its training signal, summed per loss over the step's channels as the trainer sums them:

- `rl` (advantage A): green for A > 0, red for A < 0, the shade |A| / the step's largest |A|;
- `ce` (a weight w > 0): blue, the shade w / the step's largest w;
- a token no channel trains: grey text, no colour (prompts, observations, untrained traces).

Hovering a token shows its id, the values it trains with and, for a sampled token, the sampler's logprob. The
trainer's logprobs are not stored with the step (the trainer measures only their mean gap,
`train/mismatch/mean_abs_logprob_diff` in metrics.json), so the page says so; with `rescore` (`view --rescore`)
they are recomputed by the weights the trainer trained from at the step (`trace_rl.offline.rescore`) and the hover
shows the trainer's logprob and the gap trainer - sampler too. Every secret the run knows of is redacted, as
in the rollout table.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from trace_rl import credentials
from trace_rl.config import Config
from trace_rl.data.channel import Channel
from trace_rl.data.trace import Branch, Message, Trace
from trace_rl.models.hub import resolve_model_path
from trace_rl.models.runtime import load_tokenizer
from trace_rl.offline.rescore import rescored_logprobs
from trace_rl.pipeline.channels import combine
from trace_rl.pipeline.rollout_table import known_secrets
from trace_rl.storage import RunStorage
from trace_rl.tables import read_channels, read_traces

PAGE = "episodes.html"
RESCORED = ("Trainer logprobs: recomputed in float32 by the weights the trainer trained from at this step (view "
            "--rescore); the gap is trainer - sampler.")
NOT_STORED = ("Trainer logprobs are not stored with the step: the hover shows the sampler's (view --rescore "
              "recomputes them).")

STYLE = """
body { font-family: sans-serif; margin: 1.5em; max-width: 70em; }
.episode { border: 1px solid #ccc; border-radius: 6px; padding: 0.6em 1em; margin: 1em 0; }
.episode h2 { font-size: 1em; margin: 0.2em 0; }
.error { color: #a00; }
.message { margin: 0.4em 0; padding: 0.3em 0.6em; border-left: 4px solid #999; white-space: pre-wrap; }
.role { font-weight: bold; font-size: 0.8em; display: block; }
.role-system { border-color: #777; background: #f4f4f4; }
.role-user { border-color: #36c; background: #eef3fc; }
.role-assistant { border-color: #393; background: #effaef; }
.role-tool { border-color: #c80; background: #fdf5e6; }
.tool-call { font-family: monospace; background: #fff; border: 1px dashed #393; margin-top: 0.3em; padding: 0.2em; }
.tokens { font-family: monospace; white-space: pre-wrap; line-height: 1.7; margin: 0.5em 0; }
.tok { border-radius: 2px; }
.untrained { color: #999; }
.legend span { padding: 0 0.4em; margin-right: 0.6em; }
"""


def token_colour(rl: float, ce: float, trained: bool, rl_scale: float, ce_scale: float) -> str:
    """The CSS background of a token: green/red by its advantage, blue by its ce weight, none when untrained."""
    if not trained:
        return ""
    if ce and not rl:
        alpha = min(1.0, ce / ce_scale) if ce_scale else 0.0
        return f"background: rgba(40, 90, 220, {0.15 + 0.6 * alpha:.3f})"
    alpha = min(1.0, abs(rl) / rl_scale) if rl_scale else 0.0
    red, green = (40, 170) if rl >= 0 else (220, 40)
    return f"background: rgba({red}, {green}, 40, {0.15 + 0.6 * alpha:.3f})"


def signals(traces: list[Trace], channels: list[Channel]) -> dict[tuple[str, int], dict[str, tuple]]:
    """Per (trace id, branch index): per loss, the summed values and OR-ed mask of its channels."""
    by_branch: dict[tuple[str, int, str], list[Channel]] = {}
    for channel in channels:
        by_branch.setdefault((channel.trace_id, channel.branch_index, channel.loss), []).append(channel)
    out: dict[tuple[str, int], dict[str, tuple]] = {}
    for trace in traces:
        for branch in trace.branches:
            out[(trace.id, branch.index)] = {loss: combine(by_branch.get((trace.id, branch.index, loss), []),
                                                           len(branch)) for loss in ("rl", "ce")}
    return out


def episodes_page(title: str, traces: list[Trace], channels: list[Channel], token_text: Callable[[int], str],
                  secrets: Iterable[str] = (),
                  trainer_logprobs: Mapping[tuple[str, int], np.ndarray] | None = None) -> str:
    """The page's HTML. `token_text(id)` shows one token; `trainer_logprobs` by (trace id, branch index), aligned with
    the branch's tokens, when known."""
    secrets = set(secrets)
    per_branch = signals(traces, channels)
    rl_scale = max((float(np.abs(s["rl"][0]).max(initial=0)) for s in per_branch.values()), default=0.0)
    ce_scale = max((float(s["ce"][0].max(initial=0)) for s in per_branch.values()), default=0.0)

    def text(value: str) -> str:
        return html.escape(credentials.redact(value, secrets))

    parts = [(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{text(title)}</title>"
              f"<style>{STYLE}</style></head><body><h1>{text(title)}</h1>"),
             "<p class='legend'>Tokens: <span style='background: rgba(40,170,40,.6)'>advantage &gt; 0</span>"
             "<span style='background: rgba(220,40,40,.6)'>advantage &lt; 0</span>"
             "<span style='background: rgba(40,90,220,.6)'>ce weight</span><span class='untrained'>not trained</span>"
             f"(shade: |advantage| / {rl_scale:.4g}, weight / {ce_scale:.4g}). Hover a token for its values and "
             "logprobs. " + (RESCORED if trainer_logprobs is not None else NOT_STORED) + "</p>"]
    for trace in traces:
        parts.append(f"<section class='episode' id='{text(trace.id)}'><h2>{text(trace.id)}</h2>"
                     f"<div>env {text(trace.env)} · example {text(trace.example_id)} · agent {text(trace.agent)}"
                     f"{'' if trace.trainable else ' (not trained)'} · reward {trace.reward:.4g}"
                     f" · policy step {trace.policy_step}</div>")
        if trace.error:
            parts.append(f"<div class='error'>error: {text(trace.error)}</div>")
        parts += [message_html(message, text) for message in trace.messages]
        for branch in trace.branches:
            gap_source = None if trainer_logprobs is None else trainer_logprobs.get((trace.id, branch.index))
            parts.append(tokens_html(branch, per_branch[(trace.id, branch.index)], token_text, text, rl_scale,
                                     ce_scale, gap_source))
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def message_html(message: Message, text: Callable[[str], str]) -> str:
    role = message.role
    label = role
    if role == "tool":
        label = f"tool result{f' of {message.name}' if message.name else ''}" + \
            (f" (call {message.tool_call_id})" if message.tool_call_id else "")
    calls = "".join(f"<div class='tool-call' data-tool='{text(call.name)}'>tool call {text(call.name)}"
                    f"{f' (id {text(call.id)})' if call.id else ''}: {text(json.dumps(call.arguments))}</div>"
                    for call in message.tool_calls or [])
    return (f"<div class='message role-{text(role)}' data-role='{text(role)}'><span class='role'>{text(label)}</span>"
            f"{text(message.content)}{calls}</div>")


def tokens_html(branch: Branch, signal: dict[str, tuple], token_text: Callable[[int], str],
                text: Callable[[str], str], rl_scale: float, ce_scale: float,
                trainer_logprobs: np.ndarray | None) -> str:
    (rl, rl_mask), (ce, ce_mask) = signal["rl"], signal["ce"]
    spans = []
    for t, token in enumerate(branch.token_ids.tolist()):
        trained = bool(rl_mask[t] or ce_mask[t])
        owner = int(branch.message_index[t])
        hover = [f"token {token}" + (f" of message {owner}" if owner >= 0 else " (template)")]
        if rl_mask[t]:
            hover.append(f"advantage {float(rl[t]):.4g}")
        if ce_mask[t]:
            hover.append(f"ce weight {float(ce[t]):.4g}")
        if not trained:
            hover.append("not trained")
        if branch.sampled[t]:
            sampler = float(branch.logprobs[t])
            hover.append(f"sampler logprob {sampler:.6g}")
            if trainer_logprobs is not None:
                trainer = float(trainer_logprobs[t])
                hover.append(f"trainer logprob {trainer:.6g}, gap {trainer - sampler:.3g}")
        colour = token_colour(float(rl[t]), float(ce[t]), trained, rl_scale, ce_scale)
        spans.append(f"<span class='tok{'' if trained else ' untrained'}' style='{colour}' "
                     f"title='{html.escape(' | '.join(hover))}'>{text(token_text(token))}</span>")
    return (f"<div class='tokens' data-branch='{branch.index}'>branch {branch.index} "
            f"({int(branch.sampled.sum())} sampled tokens of {len(branch)}):<br>{''.join(spans)}</div>")


def channel_files(storage: RunStorage, step: int) -> list[str]:
    """The step's channel files (`steps/<step>/channels/<NN>-<algorithm>.parquet`), in algorithm order."""
    folder = storage.step_path(step, "channels")
    if not storage.exists(folder):
        return []
    return sorted(path for path in storage.fs.ls(folder, detail=False) if path.endswith(".parquet"))


def write_episodes_page(config: Config, step: int, rescore: bool = False) -> str:
    """Write `steps/<step>/episodes.html` of the run `config` describes, through its storage; returns its URL.
    `rescore`: with the trainer's logprobs recomputed (`trace_rl.offline.rescore`)."""
    storage = RunStorage.of(config)
    traces = read_traces(storage, step)
    channels = [channel for path in channel_files(storage, step) for channel in read_channels(storage, path)]
    tokenizer = load_tokenizer(resolve_model_path(config.model.name, config.model.revision))
    texts: dict[int, str] = {}

    def token_text(token: int) -> str:
        if token not in texts:
            texts[token] = tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return texts[token]

    trainer_logprobs = rescored_logprobs(config, storage, step, traces) if rescore else None
    page = episodes_page(f"{config.name}: step {step}", traces, channels, token_text, known_secrets(config),
                         trainer_logprobs)
    path = storage.step_path(step, PAGE)
    storage.write_atomic(path, page.encode())
    return storage.url_of_path(path)
