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
    key into the cache, so the engine's pooled caches, masks and positions are exercised for real.
    """

    def __init__(self, vocab: int, logits_fn: LogitsFn) -> None:
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1)
        self.logits_fn = logits_fn
        self.calls: list[list[int]] = []
        self.batches: list[int] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ):
        batch, width = input_ids.shape
        as_keys = input_ids[:, None, :, None].float()
        keys, _ = cache.update(as_keys, as_keys, 0)  # [B, 1, L, 1], stored at true positions
        self.batches.append(batch)
        out = []
        for b in range(batch):
            count = int((position_ids[b] - position_ids[b, 0]).max()) + 1  # pads repeat the last position
            visible = attention_mask[b, 0, count - 1] == 0  # what the last real token may attend to
            history = keys[b, 0, visible, 0].long().tolist()
            past, new = history[:-count], history[-count:]
            assert new == input_ids[b, :count].tolist()
            self.calls.append(new)
            rows = [self.logits_fn(len(past) + i + 1, history[: len(past) + i + 1]) for i in range(count)]
            rows += [rows[-1]] * (width - count)
            out.append(torch.stack(rows))
        logits = torch.stack(out)  # [B, N, V]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
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
