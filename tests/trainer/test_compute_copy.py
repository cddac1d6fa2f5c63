"""The half-precision compute copy: its parameters, and the float32 gradients it hands the master weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trace_rl.models.hub import resolve_model_path
from trace_rl.trainer.compute_copy import ComputeCopy


def tiny_model(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny"), dtype=torch.float32)
    if not tied:  # an output layer of its own, as in models that do not tie
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)
    return model


def backward(module: torch.nn.Module, ids: torch.Tensor) -> None:
    logits = module(input_ids=ids).logits.float()
    torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_embedding_gradient_is_sparse_and_reaches_the_master_in_float32(tied):
    model = tiny_model(tied)
    copy = ComputeCopy(model, torch.bfloat16)
    embedding, head = copy.module.get_input_embeddings(), copy.module.get_output_embeddings()
    assert embedding.sparse and embedding.weight.dtype == torch.bfloat16
    # tied: two parameters over one storage, refreshed once
    assert embedding.weight is not head.weight
    assert (embedding.weight.data_ptr() == head.weight.data_ptr()) == tied
    assert len(copy.refreshed) == len(list(model.parameters()))

    ids = torch.tensor([[5, 9, 5, 200, 17, 9, 5, 33]])
    backward(copy.module, ids)
    rows = embedding.weight.grad
    assert rows.is_sparse and rows._values().shape == (ids.numel(), 128)
    head_grad = head.weight.grad.float() if tied else None
    copy.add_gradients()
    assert all(p.grad is None for p in copy.module.parameters())
    master = model.get_input_embeddings().weight.grad
    assert master.dtype == torch.float32

    # the reference: the embedding's rows as a dense gradient, summed in float32
    dense = torch.zeros(master.shape)
    dense.index_add_(0, rows._indices()[0], rows._values().float())
    expected = dense + head_grad if tied else dense
    assert torch.equal(master, expected)
    touched = torch.zeros(master.shape[0], dtype=torch.bool)
    touched[ids[0]] = True
    assert float(dense[touched].abs().min(dim=1).values.max()) > 0  # each token's row has its gradient
    if tied:  # the output layer's gradient on every row, the embedding's added on the rows read
        assert torch.equal(master[~touched], head_grad[~touched])
        assert not torch.equal(master[touched], head_grad[touched])
    else:
        assert not master[~touched].any()

    # the dense bfloat16 backward's gradient is the same within a few bfloat16 roundings (8 significant bits): it sums
    # the output layer's and a token's several reads in bfloat16
    reference = ComputeCopy(model, torch.bfloat16).module
    if tied:
        reference.get_input_embeddings().weight = reference.get_output_embeddings().weight
    reference.get_input_embeddings().sparse = False
    backward(reference, ids)
    gap = (reference.get_input_embeddings().weight.grad.float() - master).abs().max()
    assert 0 < gap <= master.abs().max() * 2**-6


def float32_gradient(p: torch.nn.Parameter) -> torch.Tensor:
    """p's gradient in float32, a sparse one's rows added in float32."""
    if not p.grad.is_sparse:
        return p.grad.float()
    return torch.zeros(p.shape).index_add_(0, p.grad._indices()[0], p.grad._values().float())


def test_micro_batches_sum_in_float32_and_the_next_step_starts_afresh():
    """Two micro-batches' gradients reach the master as their float32 sum; the next step, after the optimizer's
    `zero_grad(set_to_none=True)`, holds its own alone."""
    model = tiny_model(tied=True)
    copy = ComputeCopy(model, torch.bfloat16)
    batches = [torch.tensor([[5, 9, 5, 200, 17, 9]]), torch.tensor([[7, 3, 3, 40, 2, 9]])]
    halves = []
    for ids in batches:
        backward(copy.module, ids)
        halves.append({name: float32_gradient(p) for name, p in copy.module.named_parameters()})
        copy.add_gradients()
    names = [name for name, _ in copy.module.named_parameters()]
    head, embedding = "lm_head.weight", "model.embed_tokens.weight"
    for name, master in model.named_parameters():  # the tied master: the output layer's and the embedding's
        parts = [name] if name != embedding else [head, embedding]
        expected = sum(halves[0][part] for part in parts) + sum(halves[1][part] for part in parts)
        assert name in names or name == embedding
        torch.testing.assert_close(master.grad, expected, rtol=1e-6, atol=1e-7)
    model.zero_grad(set_to_none=True)
    backward(copy.module, batches[1])
    again = {name: float32_gradient(p) for name, p in copy.module.named_parameters()}
    copy.add_gradients()
    for name, master in model.named_parameters():
        parts = [name] if name != embedding else [head, embedding]
        torch.testing.assert_close(master.grad, sum(again[part] for part in parts), rtol=1e-6, atol=1e-7)
