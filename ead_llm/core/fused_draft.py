"""The engine's forward for a draft that reads its target's hidden states (:mod:`ead_llm.drafts.model`).

Each packed token at position ``p`` reads the feature of ``p - 1``: zeros inside the prompt (its keys then depend
on its tokens alone, so a cached prompt block holds what computing it would); past it, the target's final hidden
state where the target has run there (its cache keeps them), else the draft's own output there from an earlier pass
(its guess of the target's), else zeros. The runner gathers them
(:meth:`ead_llm.core.model_runner.ModelRunner.execute`); this pass joins them with the token embeddings, runs the
draft's layers on the paged cache (the same fused layer as :mod:`ead_llm.core.fused_llama`), stores its own
outputs as features in its cache, and returns logits over the vocabulary, ``-inf`` outside its head's tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from ead_llm.core.fused_llama import (
    PACK_MIN_BYTES,
    FusedLayer,
    NoAttention,
    Projection,
    RotaryTable,
    choose_kernel,
    draft_bfloat16_kernels,
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

    def __init__(self, model: Any, *, bfloat16: bool | None = None) -> None:
        """``bfloat16``: run the products in bfloat16 (:meth:`use_bfloat16`; None: where it pays)."""
        kernel = first_kernel(model)
        self.embedding = model.embed_tokens.weight
        self.fc = Projection(model.fc.weight, None, kernel=kernel)
        self.rotary = RotaryTable(model.rotary_emb)
        self.layers = [FusedLayer(layer, kernel=kernel) for layer in model.layers]
        self.norm = (model.norm.weight, float(model.norm.variance_epsilon))
        self.head = Projection(model.head.weight, None, kernel=kernel)
        self.projections = [self.fc, self.head, *(p for layer in self.layers for p in layer.projections)]
        self.index = model.vocab_index
        self.vocab = int(model.config.vocab_size)
        self.hidden = int(model.config.hidden_size)
        self.float32_kernel = choose_kernel(self.projections, passes=self.timed_pass)
        tune_widths(self.projections)
        self.bfloat16 = False
        """Whether the products run in bfloat16 (:func:`~ead_llm.core.fused_llama.draft_bfloat16_kernels`)."""
        self.use_bfloat16(self.bfloat16_pays() if bfloat16 is None else bfloat16)

    def bfloat16_pays(self) -> bool:
        """Whether bfloat16 products are the default here: a bfloat16 kernel for this CPU (its own bfloat16
        arithmetic, or ead-llm's kernel widening bfloat16 weights on AVX2:
        :func:`~ead_llm.core.fused_llama.draft_bfloat16_kernels`), and products of at least
        :data:`~ead_llm.core.fused_llama.PACK_MIN_BYTES` (a smaller draft's stay in the cache, where a call's fixed
        cost outweighs the bytes)."""
        size = sum(p.weight.numel() * p.weight.element_size() for p in self.projections)
        return self.float32_kernel is not None and size >= PACK_MIN_BYTES and bool(draft_bfloat16_kernels())

    def bfloat16_possible(self) -> bool:
        """Whether :meth:`use_bfloat16` would take: the products float32 on a CPU, and every one's rows the same bits
        in bfloat16 in any call (asked of copies, each shape probed once per process: this draft's kernels do not
        change, so a pass under way may run meanwhile)."""
        if self.float32_kernel is None:
            return False
        return any(
            all(Projection(p.weight, p.bias, kernel=None).use(kernel) for p in self.projections)
            for kernel in draft_bfloat16_kernels()
        )

    def use_bfloat16(self, on: bool) -> bool:  # noqa: FBT001 (a setter's value)
        """Run the products in bfloat16 (``on``) or as the model's float32 (its kernel as
        :func:`~ead_llm.core.fused_llama.choose_kernel` chose it); returns whether they now run in bfloat16. A draft's
        tokens are proposals its target checks, so greedy speculative decoding's text does not change; which drafts
        stand may. Where a row's bits would depend on its batch (or the model is not float32 on a CPU) they stay
        float32."""
        if on == self.bfloat16 or self.float32_kernel is None:  # nothing prepared: F.linear on the model's weights
            return self.bfloat16
        choices = draft_bfloat16_kernels() if on else (self.float32_kernel,)
        if any(all(p.use(kernel) for p in self.projections) for kernel in choices):
            self.bfloat16 = on
        else:  # every product in one precision
            for p in self.projections:
                p.use(self.float32_kernel)
            self.bfloat16 = False
        tune_widths(self.projections)
        return self.bfloat16

    def timed_pass(self, tokens: int) -> torch.Tensor:
        """A pass of ``tokens`` new tokens without attention (:class:`~ead_llm.core.fused_llama.NoAttention`), as
        :func:`~ead_llm.core.fused_llama.choose_kernel` times it."""
        positions = torch.arange(tokens)
        features = torch.zeros(tokens, self.hidden)
        return self(torch.zeros(tokens, dtype=torch.long), positions, positions, NoAttention(tokens), features)  # type: ignore[arg-type]

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
