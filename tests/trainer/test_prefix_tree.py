"""Prefix-tree packing: the trees the packer builds, and that sharing prefixes changes no loss or gradient."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.trainer.conftest import VOCAB, make_batch, storage_for
from trace_rl.config import Config
from trace_rl.data.sample import TrainingSample
from trace_rl.tables import write_batch
from trace_rl.trainer.lifecycle import train_one_step
from trace_rl.trainer.packing import collate, pack
from trace_rl.trainer.prefix_tree import build_tree
from trace_rl.trainer.trainer import Trainer, token_logprobs
from trace_rl.trainer.varlen import PACKED_ATTENTION, packed_sdpa_attention, query_pieces


def sample_of(rng: np.random.Generator, name: str, ids: np.ndarray, temperature: float, sampled: np.ndarray,
              rl_mask: np.ndarray, ce_mask: np.ndarray | None = None) -> TrainingSample:
    n = len(ids)
    ce_mask = np.zeros(n, bool) if ce_mask is None else ce_mask
    return TrainingSample(
        trace_id=name, branch_index=0, env="synthetic", input_ids=np.asarray(ids, dtype=np.int32),
        temperature=temperature, sampled=sampled,
        inference_logprobs=np.where(sampled, -rng.uniform(4.5, 7.0, n), 0.0).astype(np.float32),
        rl_values=np.where(rl_mask, rng.normal(0, 1, n), 0.0).astype(np.float32), rl_mask=rl_mask,
        ce_values=np.where(ce_mask, 0.5, 0.0).astype(np.float32), ce_mask=ce_mask,
        ref_logprobs=-rng.uniform(4.5, 7.0, n).astype(np.float32),
    )


def group(rng: np.random.Generator, name: str, size: int, prompt_len: int = 12, echo: bool = True):
    """A GRPO group: `size` completions of one prompt at temperature 0.7; the first also trains the prompt (an echo
    ce weight on shared tokens)."""
    prompt = rng.integers(0, VOCAB, prompt_len)
    samples = []
    for i in range(size):
        completion = rng.integers(0, VOCAB, int(rng.integers(4, 12)))
        ids = np.concatenate([prompt, completion])
        sampled = np.arange(len(ids)) >= prompt_len
        ce = (np.arange(len(ids)) >= 3) & ~sampled if echo and i == 0 else None
        samples.append(sample_of(rng, f"{name}-{i}", ids, 0.7, sampled, sampled.copy(), ce))
    return samples


def branches(rng: np.random.Generator, name: str, history_len: int = 20):
    """A multi-turn trace's two branches sharing a history whose tokens 8-13 were sampled (rl on both branches),
    sampled at different temperatures, so the shared tokens have a logprob per temperature."""
    history = rng.integers(0, VOCAB, history_len)
    samples = []
    for i, temperature in enumerate((1.0, 0.6)):
        ids = np.concatenate([history, rng.integers(0, VOCAB, 6 + 3 * i)])
        positions = np.arange(len(ids))
        sampled = ((positions >= 8) & (positions < 14)) | (positions >= history_len)
        samples.append(sample_of(rng, f"{name}-{i}", ids, temperature, sampled, sampled.copy()))
    return samples


def shared_batch(seed: int = 0) -> list[TrainingSample]:
    """Two groups, a two-branch trace, a sample repeated exactly, one that is a prefix of a group's sample, a
    three-level tree (a branch of a branch), and samples that share nothing."""
    rng = np.random.default_rng(seed)
    first, second = group(rng, "g0", 4), group(rng, "g1", 3)
    repeated = dataclasses.replace(first[1], trace_id="again", rl_values=-first[1].rl_values)
    cut = len(first[2]) - 3
    prefix = dataclasses.replace(first[2], trace_id="prefix", **{name: getattr(first[2], name)[:cut] for name in (
        "input_ids", "sampled", "inference_logprobs", "rl_values", "rl_mask", "ce_values", "ce_mask", "ref_logprobs")})
    deeper = branches(rng, "b")
    nested = sample_of(rng, "nested", np.concatenate([deeper[1].input_ids[:24], rng.integers(0, VOCAB, 5)]), 0.6,
                       np.arange(29) >= 24, np.arange(29) >= 24)
    alone = [dataclasses.replace(s, ref_logprobs=-np.ones(len(s), np.float32)) for s in make_batch(seed, n=2)]
    return [*first, *second, repeated, prefix, *deeper, nested, *alone]


def distinct_tokens(samples: list[TrainingSample]) -> int:
    """The positions of a trie of the samples."""
    return len({tuple(s.input_ids[:j + 1].tolist()) for s in samples for j in range(len(s))})


@pytest.fixture
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32,
                                                attn_implementation=PACKED_ATTENTION).train()


def check_paths(samples, tree) -> None:
    for sample, path in zip(samples, tree.paths):
        assert tree.row_ids[path].tolist() == sample.input_ids.tolist()
        assert tree.row_positions[path].tolist() == list(range(len(sample)))


def test_a_group_stores_its_prompt_once():
    samples = group(np.random.default_rng(1), "g", 4, prompt_len=12)
    tree = build_tree([s.input_ids for s in samples], share=True)
    check_paths(samples, tree)
    assert len(tree.row_ids) == 12 + sum(len(s) - 12 for s in samples)
    root, *continuations = tree.layout.segments
    assert root[0] == 0 and root[2] == ()
    # every other completion attends to the first one's 12 prompt positions, then to its own tokens
    assert all(context == ((0, 12),) for _, _, context in continuations) and len(continuations) == 3
    assert tree.layout.shares


def test_branches_of_branches_attend_to_each_ancestor():
    rng = np.random.default_rng(2)
    samples = [*branches(rng, "b", history_len=20)]
    samples.append(sample_of(rng, "c", np.concatenate([samples[0].input_ids[:24], [7, 7, 7]]), 1.0,
                             np.ones(27, bool), np.ones(27, bool)))
    tree = build_tree([s.input_ids for s in samples], share=True)
    check_paths(samples, tree)
    assert len(tree.row_ids) == distinct_tokens(samples)
    contexts = sorted(context for _, _, context in tree.layout.segments)
    assert contexts[0] == () and all(c and c[0][0] == 0 for c in contexts[1:])
    # the deepest branch shares 24 tokens with its neighbour, 20 of them the history
    assert max(sum(b - a for a, b in c) for c in contexts) == 24


def branch_of_branch_tree():
    """Two branches of a 20-token history and a third continuing the first after its 24th token: its context ends
    inside the first branch's segment (the row is cut there)."""
    rng = np.random.default_rng(2)
    samples = [*branches(rng, "b", history_len=20)]
    samples.append(sample_of(rng, "c", np.concatenate([samples[0].input_ids[:24], [7, 7, 7]]), 1.0,
                             np.ones(27, bool), np.ones(27, bool)))
    tree = build_tree([s.input_ids for s in samples], share=True)
    starts = {start for start, _, _ in tree.layout.segments} | {len(tree.row_ids)}
    assert any(b not in starts for _, _, context in tree.layout.segments for _, b in context)
    return tree


class OpCounts(TorchDispatchMode):
    """How many times each aten op ran inside (the forward and the backward)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.dtypes: collections.defaultdict = collections.defaultdict(set)  # of each op's first tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        if args and isinstance(args[0], torch.Tensor):
            self.dtypes[func.overloadpacket.__name__].add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def long_prompt_tree():
    """A GRPO group whose 50-token prompt is longer than its completions: the padded batch cuts it into pieces."""
    tree = build_tree([s.input_ids for s in group(np.random.default_rng(3), "long", 6, prompt_len=50)], share=True)
    assert len(query_pieces(tree.layout.segments)) > len(tree.layout.segments)
    return tree


def test_query_pieces_cut_a_row_whose_few_long_segments_pad_the_rest():
    # the demo's row (a micro-batch of its step 3): the 50- and 43-token segments are cut at 32
    own_and_context = [(50, 0), (4, 42), (12, 45), (13, 45), (12, 46), (24, 46), (25, 45), (43, 27), (5, 42),
                       *[(32, 38)] * 5, (14, 39), (14, 27), (20, 39), (13, 38), (24, 38), (24, 46), (32, 38), (18, 38),
                       (32, 38), (23, 27), (21, 38), (6, 42), (16, 46), (22, 48), (32, 38), (32, 38), (31, 39)]
    segments, start = [], 0
    for own, context in own_and_context:
        segments.append((start, start + own, ((0, context),) if context else ()))
        start += own
    pieces = query_pieces(segments)
    assert len(pieces) == len(segments) + 2 and max(end - first for first, end, _ in pieces) == 32
    assert sorted(p for first, end, _ in pieces for p in range(first, end)) == list(range(start))
    assert (0, 32, ()) in pieces and (32, 50, ((0, 32),)) in pieces  # the cut's second piece sees the first
    long = [(s, s + 43, ((0, 27),)) for s, e, c in segments if e - s == 43][0]
    assert (long[0] + 32, long[1], ((0, 27), (long[0], long[0] + 32))) in pieces
    # eight long segments after a short shared context: cutting would gather their keys once a piece, so no cut
    uniform = [(100 + 1000 * i, 1100 + 1000 * i, ((0, 100),)) for i in range(8)]
    assert query_pieces(uniform) == uniform


@pytest.mark.parametrize("tree", ["branch of a branch", "long prompt", "unshared"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_packed_attention_equals_each_sample_attending_alone_with_gradients(tree, dtype, tolerance):
    """The row's attention at each sample's path is causal attention over that sample alone (float32, from the
    same inputs), outputs and q/k/v gradients, also where a context ends inside an earlier segment (the row is cut
    there) and where the padded batch cuts a long segment into pieces; in one attention call and no concatenation,
    forward and backward."""
    if tree == "unshared":
        tree = build_tree([s.input_ids for s in shared_batch()], share=False)
    elif tree == "long prompt":
        tree = long_prompt_tree()
    else:
        tree = branch_of_branch_tree()
    torch.manual_seed(0)
    length = len(tree.row_ids)
    q, k, v = (torch.randn(1, heads, length, 16).to(dtype).requires_grad_() for heads in (4, 2, 2))
    with OpCounts() as ops:
        out, _ = packed_sdpa_attention(None, q, k, v, None, row_layout=tree.layout)
        weights = torch.randn(out.shape)
        (out * weights.to(dtype)).sum().backward()
    attention = [name for name in ops.counts if "attention" in name]
    if dtype == torch.float32:
        assert sum(ops.counts[name] for name in attention) == 2  # the forward and its backward
    else:  # in float32 GEMMs on CPU (gemm_attention.py): two in the forward, four in the backward
        assert not attention and ops.counts["bmm"] == 6 and ops.dtypes["bmm"] == {torch.float32}
    assert ops.counts["cat"] == 0
    alone_q, alone_k, alone_v = (x.detach().float().requires_grad_() for x in (q, k, v))
    expected = torch.zeros(out.shape)
    for path in tree.paths:
        index = torch.from_numpy(path)
        own = torch.nn.functional.scaled_dot_product_attention(
            alone_q[:, :, index], alone_k[:, :, index], alone_v[:, :, index], is_causal=True, enable_gqa=True)
        expected[:, index] = own.transpose(1, 2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0)
    # each row position once (a shared one from the last sample through it): the gradients the row computes
    (expected * weights).sum().backward()
    for row, alone in ((q, alone_q), (k, alone_k), (v, alone_v)):
        torch.testing.assert_close(row.grad.float(), alone.grad, atol=5 * tolerance, rtol=0)
    assert k.grad.abs().max() > 1e-2


def test_samples_sharing_nothing_sit_side_by_side():
    samples = [sample_of(np.random.default_rng(3), str(i), np.full(5, i), 1.0, np.ones(5, bool), np.ones(5, bool))
               for i in range(3)]
    for share in (True, False):
        tree = build_tree([s.input_ids for s in samples], share=share)
        assert [segment for segment in tree.layout.segments] == [(0, 5, ()), (5, 10, ()), (10, 15, ())]
        assert not tree.layout.shares
    same = build_tree([s.input_ids for s in samples[:1] * 2], share=False)
    assert len(same.row_ids) == 10  # unshared: today's packing, even for equal samples


def test_a_group_too_big_for_one_micro_batch_is_split_and_each_part_carries_the_prompt():
    samples = group(np.random.default_rng(4), "g", 8, prompt_len=30)
    limit = 30 + 3 * 11
    batches = pack(samples, limit, share_prefixes=True)
    assert len(batches) >= 3
    assert all(b.num_tokens <= limit for b in batches)
    assert sum(b.view_tokens for b in batches) == sum(len(s) for s in samples)
    prompt = samples[0].input_ids[:30].tolist()
    for b in batches:
        assert b.row_ids[:30].tolist() == prompt  # each micro-batch's tree starts with the prompt, once
        assert b.num_tokens == 30 + sum(np.bincount(b.segment_ids) - 30)
    assert sum(b.num_tokens for b in batches) < sum(len(s) for s in samples)


def test_the_output_layer_runs_only_where_a_loss_reads(model):
    """One query per distinct (position, temperature) some channel reads; none on prompts nothing trains; a shared
    token read by several samples' channels is one query."""
    rng = np.random.default_rng(5)
    samples = group(rng, "g", 3, prompt_len=10, echo=False)
    samples[0].ce_mask[4:8] = samples[1].ce_mask[4:8] = True  # both train the same shared prompt tokens
    for share in (False, True):
        (batch,) = pack(samples, 4096, share_prefixes=share)
        read = batch.rl_mask | batch.ce_mask
        assert ((batch.view_query >= 0) == read).all()
        completions = sum(len(s) - 10 for s in samples)
        assert len(batch.query_source) == completions + (4 if share else 8)
        # each query predicts its target from the row position just before it
        at = batch.view_query[read]
        assert (batch.row_positions[batch.query_source[at]] == batch.position_ids[read] - 1).all()
        assert (batch.query_target[at] == batch.input_ids[read]).all()
        assert (batch.query_temperature[at] == batch.temperature[read]).all()
        lp, _ = token_logprobs(model, batch, torch.device("cpu"))
        assert (lp[~torch.from_numpy(read)] == 0).all() and (lp[torch.from_numpy(read)] != 0).all()


def logprobs_and_gradients(model, batches, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    results = [token_logprobs(model, b, torch.device("cpu")) for b in batches]
    lp, entropy = torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])
    (weights * lp).sum().backward()
    return lp.detach(), entropy, {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_gradients_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """max |Δgrad| <= 1e-5 * max |grad| for every parameter."""
    assert a.keys() == b.keys()
    for name in a:
        largest = a[name].abs().max().item()
        assert (a[name] - b[name]).abs().max().item() <= 1e-5 * largest, name
    assert max(g.abs().max().item() for g in a.values()) > 1e-3


def test_shared_logprobs_entropies_and_gradients_equal_the_unshared(model):
    samples = shared_batch()
    on, off = collate(samples, share=True), collate(samples, share=False)
    assert on.num_tokens == distinct_tokens(samples) < off.num_tokens
    weights = torch.from_numpy(np.random.default_rng(0).normal(size=off.view_tokens).astype(np.float32))
    lp_on, entropy_on, grads_on = logprobs_and_gradients(model, [on], weights)
    lp_off, entropy_off, grads_off = logprobs_and_gradients(model, [off], weights)
    torch.testing.assert_close(lp_on, lp_off, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy_on, entropy_off, atol=1e-5, rtol=0)
    assert_gradients_equal(grads_off, grads_on)


LOSSES = [
    {"policy": "dppo"},
    {"policy": "ppo", "ppo": {"clip_c": 3.0}, "aggregation": "seq-mean-token-sum"},
    {"policy": "gspo", "aggregation": "seq-mean-token-mean"},
    {"policy": "cispo", "aggregation": "seq-mean-token-sum-norm", "norm_tokens": 16},
    {"policy": "sapo", "correction": {"level": "geometric", "mode": "mask", "low": 0.05, "high": 20.0}},
    {"policy": "reinforce", "correction": {"level": "sequence", "mode": "truncate", "high": 2.0}},
    {"policy": "dppo", "correction": {"level": "token", "mode": "truncate", "high": 1.5},
     "kl": {"coef": 0.1, "estimator": "k3+"}},
    {"policy": "ppo", "kl": {"coef": 0.2, "estimator": "k2"}, "aggregation": "seq-mean-token-mean"},
]


def step_gradients(config, samples) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    trainer = Trainer(config, storage_for(config))
    metrics = trainer.optimizer_step(0, samples)
    return metrics, {name: p.grad.clone() for name, p in trainer.module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss, micro_batch_tokens", [(loss, (4096, 70)[i % 2]) for i, loss in enumerate(LOSSES)])
def test_a_step_shares_without_changing_loss_metrics_or_gradients(make_config, loss, micro_batch_tokens):
    """Every policy loss, aggregation, correction and the KL, each over 1 micro-batch or over 3 (share on)."""
    samples = shared_batch(1)
    results = {}
    for share in (True, False):
        config = make_config(f"share-{share}", micro_batch_tokens=micro_batch_tokens, share_prefixes=share,
                             max_grad_norm=1e9)
        if "kl" in loss:  # the KL's reference (the batch carries its logprobs; the trainer never loads it)
            config = Config(**{**config.model_dump(), "models": {"reference": {"name": "tiny", "tokens": True}}})
        config.trainer.loss = loss
        results[share] = step_gradients(config, samples)
    (on, grads_on), (off, grads_off) = results[True], results[False]
    assert on["micro_batches"] == (1 if micro_batch_tokens == 4096 else 3)
    assert on["tokens"] == distinct_tokens(samples) if micro_batch_tokens == 4096 else on["tokens"] < off["tokens"]
    assert on["samples"] == off["samples"] == len(samples)
    assert on["sample_tokens"] == off["sample_tokens"] and on["output_positions"] < off["output_positions"]
    for name in off:
        if name not in ("tokens", "micro_batches", "output_positions"):
            assert on[name] == pytest.approx(off[name], rel=1e-5, abs=1e-6), name
    assert on["loss/ce"] != 0 and (on["loss/kl"] != 0 if "kl" in loss else True)
    assert_gradients_equal(grads_off, grads_on)


def test_lora_gradients_are_the_same_shared(make_config):
    samples = shared_batch(2)
    results = {}
    for share in (True, False):
        config = make_config(f"lora-{share}", share_prefixes=share, max_grad_norm=1e9)
        config.model.lora = {"rank": 4, "alpha": 8.0}
        results[share] = step_gradients(config, samples)
    assert results[True][0]["tokens"] < results[False][0]["tokens"]
    assert_gradients_equal(results[False][1], results[True][1])


@pytest.mark.slow
def test_two_gloo_ranks_sharing_train_the_one_process_unshared_step(make_config):
    """2 DDP ranks with shared prefixes end the step with the weights of one unshared process."""
    from tests.trainer.test_trainer import exported

    stores = {}
    for name, options in {"single": {"share_prefixes": False}, "double": {"num_processes": 2}}.items():
        config = make_config(name, micro_batch_tokens=70, lr=1e-5, **options)
        stores[name] = storage_for(config)
        write_batch(stores[name], 0, shared_batch(3))
        train_one_step(config, stores[name], 0)
    a, b = exported(stores["single"], 0), exported(stores["double"], 0)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


def test_three_steps_of_a_run_end_with_the_same_weights_shared_or_not(tmp_path):
    """The reverse-text demo task, 3 steps on the hf sampler (GRPO groups of 4 sharing their prompts), in process."""
    from safetensors.torch import load_file

    from tests.flows.conftest import small_config
    from trace_rl.runs.loading import validate_config
    from trace_rl.pipeline.session import Session
    from trace_rl.pipeline.step import run_step

    weights, tokens = {}, {}
    for share in (True, False):
        data = small_config(str(tmp_path), f"share-{share}", steps=3)
        data["trainer"] = {**data["trainer"], "device": "cpu", "share_prefixes": share}
        session = Session(validate_config(data))
        tokens[share] = [run_step(session, step)["train"]["metrics"]["tokens"] for step in (1, 2, 3)]
        weights[share] = load_file(f"{session.storage.path('weights', '000003')}/model.safetensors")
    assert all(on < off for on, off in zip(tokens[True], tokens[False]))
    for name, value in weights[False].items():
        torch.testing.assert_close(weights[True][name], value, atol=1e-5, rtol=0)
