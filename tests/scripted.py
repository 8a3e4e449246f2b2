"""A scripted-logits stand-in for a causal LM: the engine's policy logic without real models."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from transformers import LlamaConfig

from ead_llm.core.loading import LoadedModel, ModelInfo, ModelPair
from ead_llm.core.types import Role
from ead_llm.testing.tiny import char_tokenizer

# logits_fn(position, sequence) -> [V] logits predicting the token at ``position``
LogitsFn = Callable[[int, list[int]], torch.Tensor]


class ScriptedModel(torch.nn.Module):
    """Returns chosen logits for each position; records each row's new tokens per forward.

    It keeps its history where a real model keeps its keys: it writes each token id as a one-number
    key into the engine's paged KV cache and reads every row's history back from it, so the
    engine's blocks, positions and packing are exercised for real.
    """

    handles_ead_batch = True  # takes the engine's packed batch itself (no transformers attention)

    def __init__(self, vocab: int, logits_fn: LogitsFn) -> None:
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
        self.logits_fn = logits_fn
        self.calls: list[list[int]] = []
        self.batches: list[int] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: torch.Tensor | int = 0,
        use_cache: bool = False,
        ead_batch=None,
    ):
        ids = input_ids[0]  # [T], rows packed one after another
        as_keys = ids[None, None, :, None].float()  # [1, H=1, T, D=1]
        ead_batch.write(0, as_keys, as_keys)
        rows = []
        at = 0
        for stored, start, count in zip(ead_batch.histories(0), ead_batch.starts, ead_batch.counts, strict=True):
            history = stored[:, 0, 0].long().tolist()
            new = history[start : start + count]
            assert new == ids[at : at + count].tolist()
            assert position_ids[0, at : at + count].tolist() == list(range(start, start + count))
            self.calls.append(new)
            rows += [self.logits_fn(start + j + 1, history[: start + j + 1]) for j in range(count)]
            at += count
        self.batches.append(len(ead_batch.counts))
        logits = torch.stack(rows)[None]  # [1, T, V]
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        return SimpleNamespace(logits=logits)


def peaked(vocab: int, token: int, sharpness: float) -> torch.Tensor:
    """Logits putting ``sharpness`` more on ``token`` than on the rest (0 gives uniform)."""
    logits = torch.zeros(vocab)
    logits[token] = sharpness
    return logits


def info(source: str, params: int) -> ModelInfo:
    return ModelInfo(
        source=source, params=params, non_embedding_params=params, num_layers=2, attention_width=8, max_positions=None
    )


def scripted_pair(small_fn: LogitsFn, large_fn: LogitsFn) -> tuple[ModelPair, ScriptedModel, ScriptedModel]:
    tokenizer = char_tokenizer()
    vocab = len(tokenizer)
    small = ScriptedModel(vocab, small_fn)
    large = ScriptedModel(vocab, large_fn)
    pair = ModelPair(
        tokenizer=tokenizer,
        small=LoadedModel(Role.SMALL, small, info("scripted-small", 100)),  # type: ignore[arg-type]
        large=LoadedModel(Role.LARGE, large, info("scripted-large", 1000)),  # type: ignore[arg-type]
        device=torch.device("cpu"),
        vocab_size=vocab,
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
    )
    return pair, small, large
