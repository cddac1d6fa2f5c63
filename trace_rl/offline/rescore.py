"""The trainer's side of a step's logprobs, recomputed for `trace-rl view --rescore`: the trainer does not store
the logprobs it computes (only their mean distance to the sampler's, `train/mismatch/mean_abs_logprob_diff`).

Step s's traces are scored with transformers, in float32, by the weights the trainer trained from at that step
(`weights/<s - 1>`, the base model at step 1; in a synchronous run the weights that sampled the step, in an async
one newer, so the gap also shows the staleness the trainer saw): log p(x_t | x_<t) of every token t >= 1, at the
branch's temperature on sampled tokens and at temperature 1 elsewhere, as the trainer scores a sample
(`batch.parquet`'s `temperature`, `sampled`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator

import numpy as np

from trace_rl.config import Config
from trace_rl.data.trace import Branch, Trace
from trace_rl.errors import RefusedError
from trace_rl.models.hub import resolve_model_path
from trace_rl.models.lora import is_adapter_dir
from trace_rl.storage import RunStorage, step_name


@contextlib.contextmanager
def weights_of(config: Config, storage: RunStorage, weights_step: int) -> Iterator[str]:
    """A local folder of the full weights after step `weights_step` (0: the base model); a RefusedError when the run
    no longer keeps them or holds a LoRA adapter there."""
    if weights_step == 0:
        yield resolve_model_path(config.model.name, config.model.revision)
        return
    directory = storage.path("weights", step_name(weights_step))
    if not storage.is_stable(directory):
        raise RefusedError(f"--rescore: the weights of step {weights_step}, which the trainer trained this step from, "
                           f"are no longer kept in {storage.url} ([ckpt] keep_weights_every); view it without "
                           "--rescore")
    with tempfile.TemporaryDirectory(prefix="trace-rl-rescore-") as local:
        storage.download_dir(directory, local)
        if is_adapter_dir(local):
            raise RefusedError("--rescore: the run trains a LoRA adapter; rescoring reads full weights only, view "
                               "it without --rescore")
        yield local


def branch_logprobs(model, branch: Branch) -> np.ndarray:
    """log p(x_t | x_<t) for t >= 1 (token 0: 0), aligned with the branch's tokens."""
    import torch

    ids = torch.tensor(branch.token_ids, dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    temperature = torch.where(torch.as_tensor(branch.sampled[1:]), float(branch.temperature), 1.0)
    scored = torch.log_softmax(logits / temperature[:, None], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return np.concatenate([[0.0], scored.numpy()]).astype(np.float32)


def rescored_logprobs(config: Config, storage: RunStorage, step: int,
                      traces: list[Trace]) -> dict[tuple[str, int], np.ndarray]:
    """Per (trace id, branch index) of step `step`'s traces, the logprobs of the branch's tokens by the weights the
    trainer trained from at that step."""
    from transformers import AutoModelForCausalLM

    with weights_of(config, storage, step - 1) as folder:
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype="float32").eval()
        return {(trace.id, b.index): branch_logprobs(model, b) for trace in traces for b in trace.branches}
