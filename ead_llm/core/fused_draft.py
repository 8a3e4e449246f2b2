"""The engine's forward for a draft that reads its target's hidden states (:mod:`ead_llm.drafts.model`).

Each packed token at position ``p`` reads the feature of ``p - 1``: the target's final hidden state where the
target has run there (its cache keeps them), else the draft's own output there from an earlier pass (its guess
of the target's), else zeros (a prompt the draft reads first). The runner gathers them
(:meth:`ead_llm.core.model_runner.ModelRunner.execute`); this pass joins them with the token embeddings, runs the
draft's layers on the paged cache (the same fused layer as :mod:`ead_llm.core.fused_llama`), stores its own
outputs as features in its cache, and returns logits over the vocabulary, ``-inf`` outside its head's tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from ead_llm.core.fused_llama import (
    FusedLayer,
    Projection,
    RotaryTable,
    choose_kernel,
    first_kernel,
    rms_norm,
    tune_widths,
)

if TYPE_CHECKING:
    from ead_llm.core.model_runner import PackedBatch


def reads_features(model: Any) -> bool:
    """Whether ``model`` is a draft that needs its target's hidden states."""
    return bool(getattr(model, "reads_target_features", False))


class FusedDraft:
    """A feature-reading draft's forward on a packed batch."""

    def __init__(self, model: Any) -> None:
        kernel = first_kernel(model)
        self.embedding = model.embed_tokens.weight
        self.fc = Projection(model.fc.weight, None, kernel=kernel)
        self.rotary = RotaryTable(model.rotary_emb)
        self.layers = [FusedLayer(layer, kernel=kernel) for layer in model.layers]
        self.norm = (model.norm.weight, float(model.norm.variance_epsilon))
        self.head = Projection(model.head.weight, None, kernel=kernel)
        self.projections = [self.fc, self.head, *(p for layer in self.layers for p in layer.projections)]
        choose_kernel(self.projections)
        tune_widths(self.projections)
        self.index = model.vocab_index
        self.vocab = int(model.config.vocab_size)
        self.hidden = int(model.config.hidden_size)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: PackedBatch, features: torch.Tensor
    ) -> torch.Tensor:
        """``ids``, ``positions``: [T]; ``features``: [T, hidden], each token's predecessor's; ``keep``: [N] packed
        indices read -> logits [N, V] (model dtype, ``-inf`` outside the head's tokens)."""
        x = self.fc(torch.cat((F.embedding(ids, self.embedding), features.to(self.fc.weight.dtype)), dim=-1))[None]
        cos, sin = self.rotary(x, positions, batch.length)
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        out = rms_norm(x, *self.norm)[0]  # [T, hidden]
        batch.cache.write_features(batch.write_slots, out)
        sub = self.head(out[keep])  # [N, K]
        logits = sub.new_full((sub.shape[0], self.vocab), float("-inf"))
        logits[:, self.index] = sub
        return logits
