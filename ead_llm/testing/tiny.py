"""Tiny tokenizers and randomly initialised model pairs, for tests, demos and speed benchmarks.

A tiny pair is saved to a folder and loaded back through ``from_pretrained`` like any Hub pair.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-*=:#.,?!\n"


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET, *, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: ids 0-3 are ``<pad> <s> </s> <unk>``, then one per character."""
    chars = list(dict.fromkeys(alphabet))
    vocab = {token: i for i, token in enumerate([*SPECIALS, *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    if add_bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def byte_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer trained on ``corpus`` (multi-byte characters span tokens)."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(corpus), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


def widened_tokenizer(tokenizer: PreTrainedTokenizerFast, size: int, *, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE ``tokenizer`` grown to ``size`` ids by merges of pairs of its own word tokens
    (seeded): a stand-in for a 150k vocabulary (Qwen2's 151,936) where only a smaller one is on disk.
    The added tokens are real BPE merges, so text still encodes and decodes exactly."""
    import json
    import random

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError("widened_tokenizer takes a BPE tokenizer")
    vocab: dict[str, int] = model["vocab"]
    taken = len(vocab) + len(spec.get("added_tokens", ()))
    if size < taken:
        raise ValueError(f"size must be at least the tokenizer's {taken} ids, got {size}")
    words = [t for t in vocab if t.startswith("\u0120") and len(t) > 2]  # "Ġword": a word after a space
    pieces = [t for t in vocab if t.isalpha()]
    rng = random.Random(seed)
    merges = list(model["merges"])
    next_id = max([*vocab.values(), *(t["id"] for t in spec.get("added_tokens", ()))]) + 1
    while next_id < size:
        left, right = rng.choice(words), rng.choice(pieces)
        if left + right in vocab:
            continue
        vocab[left + right] = next_id
        merges.append([left, right] if isinstance(merges[0], list) else f"{left} {right}")
        next_id += 1
    model["merges"] = merges
    core = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        unk_token=tokenizer.unk_token,
        pad_token=tokenizer.pad_token,
        clean_up_tokenization_spaces=False,
    )


def big_vocab_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with ``size`` tokens ``t0 .. t{size-1}`` (the engine detokenizes with it)."""
    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="t0", eos_token="t1", bos_token="t2", unk_token="t3"
    )


@dataclass(frozen=True)
class TinyShape:
    """Size of a tiny model."""

    hidden: int = 32
    layers: int = 2
    heads: int = 4
    mlp: int = 64


SMALL_SHAPE = TinyShape(hidden=32, layers=2, heads=4, mlp=64)
LARGE_SHAPE = TinyShape(hidden=96, layers=3, heads=4, mlp=256)


def tiny_model(
    family: Literal["llama", "gpt2"],
    shape: TinyShape,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int,
    max_positions: int = 512,
    init_scale: float = 0.2,
) -> LlamaForCausalLM | GPT2LMHeadModel:
    """A randomly initialised causal LM of ``family`` whose vocabulary is ``tokenizer``'s.

    ``init_scale`` (weight init std) is larger than the usual 0.02 so that the random model's
    next-token distributions are peaked and varied rather than near uniform.
    """
    ids: dict[str, Any] = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config: Any
    if family == "llama":
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=shape.hidden,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.heads,
            intermediate_size=shape.mlp,
            max_position_embeddings=max_positions,
            initializer_range=init_scale,
            tie_word_embeddings=False,
            **ids,
        )
    elif family == "gpt2":
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=shape.hidden,
            n_layer=shape.layers,
            n_head=shape.heads,
            n_inner=shape.mlp,
            n_positions=max_positions,
            initializer_range=init_scale,
            **ids,
        )
    else:
        raise ValueError(f"family must be 'llama' or 'gpt2', got {family!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config) if family == "llama" else GPT2LMHeadModel(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.eval()


def build_tiny_pair(
    folder: str | Path,
    *,
    family: Literal["llama", "gpt2"] = "llama",
    tokenizer: PreTrainedTokenizerFast | None = None,
    small: TinyShape = SMALL_SHAPE,
    large: TinyShape = LARGE_SHAPE,
    seed: int = 0,
    max_positions: int = 512,
    init_scale: float = 0.2,
) -> tuple[Path, Path]:
    """Save a random tiny pair with one tokenizer under ``folder``; return the two model folders."""
    root = Path(folder)
    tokenizer = tokenizer or char_tokenizer()
    paths = []
    for name, shape, model_seed in (("small", small, seed), ("large", large, seed + 1)):
        path = root / name
        model = tiny_model(
            family, shape, tokenizer, seed=model_seed, max_positions=max_positions, init_scale=init_scale
        )
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
