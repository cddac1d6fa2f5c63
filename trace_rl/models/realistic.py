"""A random-weight Qwen2 model laid out like a real Hub download, for tests that need a realistic model.

The tiny model (`trace_rl.models.tiny`) is convenient but unlike any real chat model: one token per
byte, an embedding exactly the size of its tokenizer, no generation defaults. Real models
(Qwen2.5, Qwen3) differ in every way that has broken RL pipelines before, so this fixture
copies those traits while staying small enough for CPU tests:

- it lives in a Hugging Face hub cache (`models--trace-rl--qwen2-fixture/snapshots/<commit>/`,
  files as symlinks into `blobs/`, `refs/main` naming the commit), so it is found by hub id
  with `HF_HUB_CACHE=<cache_root>` and `HF_HUB_OFFLINE=1`, exactly like a downloaded model;
- its tokenizer is a byte-level BPE trained here (a few thousand tokens, Qwen's pre-tokenizer
  and special tokens, Qwen's `Qwen2Tokenizer` class), while its embedding has Qwen's 151936
  rows: ids past the tokenizer exist in the model but are never meant to be sampled;
- `<tool_call>`, `</tool_call>`, `<think>`, `</think>`, `<tool_response>`, `</tool_response>`
  are single added tokens that are not "special" (as in Qwen3's tokenizer), so decoding
  with `skip_special_tokens=True` keeps them while it drops `<|im_start|>`/`<|im_end|>`;
- the chat template is Qwen-style, with tools and Hermes-format tool calls
  (`trace_rl/models/qwen_style.jinja`);
- `generation_config.json` has non-neutral sampling defaults (top_k 20, top_p 0.8,
  temperature 0.7, repetition_penalty 1.05) and two eos ids, as Qwen's instruct models do:
  a sampler that lets them leak into RL sampling samples from another distribution than
  the trainer scores;
- `config.json` is written the way Hub checkpoints are (`torch_dtype: bfloat16`, `rope_theta`,
  `sliding_window` with `use_sliding_window: false`) and the safetensors hold bfloat16
  weights without the tied `lm_head.weight`, as Qwen2.5-0.5B ships.

Everything is deterministic from the seed: the same spec gives the same commit hash and
bytes, so a build is done once per cache and reused (the commit hash is derived from the spec).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

REPO_ID = "trace-rl/qwen2-fixture"
FIXTURE_VERSION = 1

# Qwen's regex pre-tokenizer: contractions, letter runs (with one leading non-letter), single
# digits, punctuation runs, newlines and other whitespace. transformers' Qwen2Tokenizer rebuilds
# its pipeline with this pattern, so the trained tokenizer must be trained with it too.
QWEN_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special: dropped by skip_special_tokens
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

VOCAB_SIZE = 151936  # Qwen2/2.5/3's embedding rows
ARCHITECTURE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 32: vLLM's CPU attention needs at least that
    "num_key_value_heads": 1,  # grouped-query attention, as Qwen uses
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# Qwen2.5-0.5B's shape (494M parameters), for the GPU check (bench/gpu_check.py); tests use ARCHITECTURE
QWEN25_05B = {**ARCHITECTURE, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2}
BPE_VOCAB = 4000
# Embedding dimension 0 is shifted up for every token the tokenizer has and set far below zero for
# the rows past it (which are never inputs): with tied embeddings that makes the ids a real model
# never emits (Qwen's padding rows) improbable, as they are in a trained model.
USED_ROW_OFFSET = 0.5
UNUSED_ROW_VALUE = -4.0
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def chat_template() -> str:
    """The Qwen-style chat template beside this fixture (tools, Hermes tool calls, <think> reasoning)."""
    return (Path(__file__).parent / "qwen_style.jinja").read_text()


def repo_folder(cache_root: Path, repo_id: str = REPO_ID) -> Path:
    """The hub cache's folder for a model repo: `models--<org>--<name>`."""
    return Path(cache_root) / ("models--" + repo_id.replace("/", "--"))


def fixture_commit(seed: int = 0, architecture: dict = ARCHITECTURE) -> str:
    """The fixture's 40-hex commit hash: a digest of everything that determines its bytes."""
    spec = {"version": FIXTURE_VERSION, "seed": seed, "vocab_size": VOCAB_SIZE, "bpe_vocab": BPE_VOCAB,
            "offsets": [USED_ROW_OFFSET, UNUSED_ROW_VALUE], "generation": GENERATION_DEFAULTS,
            "template": chat_template(), **architecture}
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def build_realistic_model(
    cache_root: Path, repo_id: str = REPO_ID, revision_name: str = "main", seed: int = 0,
    architecture: dict = ARCHITECTURE,
) -> Path:
    """Build (once) the fixture into the hub cache at `cache_root` and return its snapshot directory.

    The snapshot is staged in a temporary directory and moved into place with `os.replace`, then
    `refs/<revision_name>` is written (also atomically), so a reader never sees half a model.
    """
    commit = fixture_commit(seed, architecture)
    repo = repo_folder(cache_root, repo_id)
    snapshot = repo / "snapshots" / commit
    if not (snapshot / "model.safetensors").exists():
        repo.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=repo))
        try:
            write_model_files(staging / "files", seed, architecture)
            link_snapshot(staging / "files", staging / "snapshot", repo / "blobs")
            (repo / "snapshots").mkdir(exist_ok=True)
            try:
                os.replace(staging / "snapshot", snapshot)
            except OSError:
                if not (snapshot / "model.safetensors").exists():  # not a concurrent builder's finished copy
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    write_atomically(repo / "refs" / revision_name, commit)
    return snapshot


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.read_text() == text:
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def link_snapshot(files: Path, snapshot: Path, blobs: Path) -> None:
    """Lay `files` out as the hub cache does: each file's bytes in `blobs/<sha256>`, the snapshot
    holding relative symlinks to them (Git blobs are named by their git sha1 on the Hub; any
    content hash works for readers, which only follow the links)."""
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir()
    for path in sorted(files.iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if not (blobs / digest).exists():
            path.chmod(0o644)  # staged files may be private (mkdtemp, safetensors); cached blobs are not
            os.replace(path, blobs / digest)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", digest))


def write_model_files(directory: Path, seed: int, architecture: dict = ARCHITECTURE) -> None:
    """config.json, model.safetensors, tokenizer files and generation_config.json into `directory`."""
    directory.mkdir(parents=True)
    tokenizer = build_tokenizer(seed)
    tokenizer.save_pretrained(directory)
    # name the class real Qwen checkpoints name, so AutoTokenizer loads it the way it loads theirs
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "Qwen2Tokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_window_layers": architecture["num_hidden_layers"],
        "rope_scaling": None,
        "sliding_window": architecture["max_position_embeddings"],
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
        **architecture,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        **GENERATION_DEFAULTS,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    write_weights(directory, seed, tokenizer_size=len(tokenizer))


def write_weights(directory: Path, seed: int, tokenizer_size: int) -> None:
    """Random Qwen2 weights from `seed` (without touching the global torch RNG), saved in bfloat16."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config.from_pretrained(directory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        embedding = model.model.embed_tokens.weight
        embedding[:tokenizer_size, 0] += USED_ROW_OFFSET
        embedding[tokenizer_size:, 0] = UNUSED_ROW_VALUE
    state = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in model.state_dict().items()
             if name != "lm_head.weight"}  # tied to the embedding, so Hub checkpoints leave it out
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})


def build_tokenizer(seed: int = 0):
    """A byte-level BPE trained on generated text, with Qwen's pre-tokenizer, tokens and template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(training_text(seed), trainer=trainer)
    # added after training, so their ids come after the BPE vocabulary, as Qwen's do
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
        model_max_length=ARCHITECTURE["max_position_embeddings"], clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template()
    return tokenizer


WORDS = (
    "the a an of to in and or but is are was were be been has have had do does did not no yes this that these "
    "those it its they them their we our you your he she his her i me my what which who when where why how all "
    "any each every some many much more most few less other such only own same so than too very can will just "
    "should now time year people way day man woman child world life hand part place case week company system "
    "program question work government number night point home water room mother area money story fact month "
    "lot right study book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education find sort list reverse count add search look read "
    "write call return answer tool function value key file path string number letter first last next before "
    "after between under over again further then once here there about against during without within along "
    "following across behind beyond plus except up down out off above below small large long short high low "
    "good new old great big little different important large young early late hard easy possible able sure "
    "true false open close start stop begin keep help show try ask need feel become leave put mean let seem "
    "think know take see come want use give tell say get make go run move live believe hold bring happen"
).split()


ONSETS = "b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sh sl sp st str th tr".split()
VOWELS = "a e i o u ai ea ee ie oo ou".split()
CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "ll"]


def pseudo_word(rng: random.Random) -> str:
    """An English-looking made-up word of one to three syllables."""
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.randint(1, 3)))


def training_text(seed: int, sentences: int = 4000):
    """English-ish sentences, numbers, JSON tool calls and bits of code: what chat data looks like to BPE.

    Common words come from WORDS, rarer ones from a few thousand made-up words drawn with falling
    (Zipf-like) weights, so BPE keeps finding merges up to a vocabulary of a few thousand."""
    rng = random.Random(seed)
    lexicon = sorted({pseudo_word(rng) for _ in range(4000)})
    rng.shuffle(lexicon)
    cumulative = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(lexicon))))

    def word() -> str:
        return rng.choice(WORDS) if rng.random() < 0.6 else rng.choices(lexicon, cum_weights=cumulative)[0]

    for i in range(sentences):
        sentence = " ".join(word() for _ in range(rng.randint(4, 16))).capitalize()
        sentence += rng.choice([".", ".", ".", "?", "!", ":", ","])
        if i % 5 == 0:
            sentence += f" {rng.randint(0, 10 ** rng.randint(1, 6))}"
        if i % 7 == 0:
            sentence += "\n" + json.dumps({"name": word(), "arguments": {word(): word()}})
        if i % 11 == 0:
            sentence += f"\ndef {word()}_{word()}(x):\n    return x + {rng.randint(0, 99)}\n"
        yield sentence
