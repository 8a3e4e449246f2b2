"""Side-effect-free tensor and cost math used by the engine, the sampler and the ledger."""

from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)
TINY = 1e-30
"""The smallest temperature divided by (a smaller one is as greedy and would overflow float32)."""


def entropy_bits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of ``softmax(logits)`` over the last dimension.

    ``logits``: [..., V] raw logits (before temperature); returns [...] float32.
    ``-inf`` logits (masked tokens) contribute nothing (their ``0 * -inf`` terms are skipped).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [..., V]
    return -(logp.exp() * logp).nansum(dim=-1) * LOG2E


def apply_temperature(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Scale ``logits`` [..., V] by ``1 / temperature`` (> 0; a float, or a tensor broadcasting against the
    logits such as [B, 1]), after shifting each row's maximum to 0: the same distribution, but a tiny
    temperature cannot overflow to inf (and NaN)."""
    if isinstance(temperature, (int, float)):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 here, got {temperature}")
        temperature = max(float(temperature), TINY)
    else:
        temperature = torch.clamp(temperature, min=TINY)
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    # a temperature below float32's range would divide by 0; at TINY the maxima stay 0, the rest -inf
    return shifted / temperature


def top_k_filter(scaled: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """``scaled`` ``[B, V]`` with each row's tokens below its ``top_k``-th largest value set to -inf (``top_k`` ``[B]``,
    0 keeps the row; ``max_top_k``: the largest of them). Ties at the cut are kept: a row keeps every token as
    likely as its k-th, so the kept set is a function of the values alone (never of an index order)."""
    if max_top_k == 0:
        return scaled
    k = min(max_top_k, scaled.shape[-1])
    kth = torch.topk(scaled, k, dim=-1).values  # [B, k], sorted: the values, whatever order ties come in
    cut = kth.gather(1, (torch.clamp(top_k, min=1, max=k) - 1)[:, None])  # [B, 1]
    return torch.where((top_k > 0)[:, None] & (scaled < cut), -torch.inf, scaled)


def top_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus filter on [..., V]: keep each token whose strictly more likely tokens hold less than ``p`` of the
    mass (``p`` a float, or per row a tensor such as [B, 1]). That is the smallest set of most likely tokens
    reaching ``p``, with ties at its edge kept together: the kept set is a function of the values alone. The
    most likely tokens are always kept; ``p >= 1`` keeps every token. Masses are summed in float64."""
    if isinstance(p, (int, float)) and p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [..., V]
    probs = torch.softmax(sorted_logits.double(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens sorted before each
    # the mass strictly more likely than a token is ``before`` at the first token of its tie group
    starts = torch.ones_like(sorted_logits, dtype=torch.bool)
    starts[..., 1:] = sorted_logits[..., 1:] != sorted_logits[..., :-1]
    index = torch.arange(sorted_logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    first = torch.where(starts, index, 0).cummax(dim=-1).values
    threshold = torch.as_tensor(p, dtype=torch.float64, device=logits.device)
    drop_sorted = (before.gather(-1, first) >= threshold) & (threshold < 1.0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    max_top_k: int,
    any_top_p: bool,
) -> torch.Tensor:
    """The one sampling filter: temperature, then top-k, then top-p on what top-k left, ties at each cut kept.

    ``logits``: [B, V] raw; ``temperature`` [B] (> 0), ``top_p`` [B] float; ``top_k`` [B] int (0: off), at most
    ``max_top_k``; ``any_top_p``: whether a row's ``top_p`` is below 1 (only those rows are sorted). Returns
    [B, V] float32 scaled logits, -inf outside each row's kept set. The sampler, the drafts, speculative
    verification and the recovery draw all go through it, so a token is drawable by one exactly when
    the others give it probability above zero.
    """
    scaled = top_k_filter(apply_temperature(logits, temperature[:, None]), top_k, max_top_k)
    if not any_top_p:
        return scaled
    nucleus = (top_p < 1.0).nonzero().flatten()
    if len(nucleus) == scaled.shape[0]:
        return top_p_filter(scaled, top_p[:, None])
    return scaled.index_copy(0, nucleus, top_p_filter(scaled[nucleus], top_p[nucleus, None]))


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    max_top_k: int,
    any_top_p: bool,
) -> torch.Tensor:
    """The sampling distributions ``[B, V]`` of :func:`filter_logits` (same arguments)."""
    return torch.softmax(
        filter_logits(logits, temperature, top_k, top_p, max_top_k=max_top_k, any_top_p=any_top_p), dim=-1
    )


def top_two(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The most and second most likely token of each row of ``logits`` ``[B, V]`` -> two ``[B]``, the lower id
    first among equal values (greedy's rule; ``torch.topk`` leaves the order of ties unspecified)."""
    first = torch.argmax(logits, dim=-1)  # [B]
    second = torch.argmax(logits.scatter(-1, first[:, None], -torch.inf), dim=-1)
    return first, second


def parameter_ratio(large_fraction: float, small_params: int, large_params: int) -> float:
    """The EAD paper's cost metric ``f_L + (1 - f_L) * P_S / P_L``."""
    if not 0.0 <= large_fraction <= 1.0:
        raise ValueError(f"large_fraction must be in [0, 1], got {large_fraction}")
    return large_fraction + (1.0 - large_fraction) * small_params / large_params


def forward_flops(
    *,
    new_tokens: int,
    past_tokens: int,
    non_embedding_params: int,
    num_layers: int,
    attention_width: int,
) -> int:
    """Forward FLOPs of one pass over ``new_tokens`` positions after ``past_tokens`` cached ones.

    Per position at context length ``c`` (itself included): ``2 * N`` for the matrix multiplies
    of the ``N`` non-embedding parameters, plus ``4 * layers * c * width`` for attention
    (``QK^T`` and the weighted sum of ``V``, ``2 * c * width`` each per layer), where ``width``
    is query heads times head size. Embedding and unembedding are excluded (Kaplan et al. 2020).
    """
    if new_tokens < 0 or past_tokens < 0:
        raise ValueError("token counts must be >= 0")
    dense = 2 * non_embedding_params * new_tokens
    # sum of context lengths past+1 .. past+new
    context_sum = new_tokens * past_tokens + new_tokens * (new_tokens + 1) // 2
    attention = 4 * num_layers * attention_width * context_sum
    return dense + attention


def top_k_entropy_nats(logits: torch.Tensor, k: int = 20) -> torch.Tensor:
    """Entropy in nats of the top-``k`` probabilities of ``softmax(logits)``, renormalised (EAGER's measure).
    ``-inf`` logits (tokens a grammar forbids) count as probability 0."""
    top = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1).values
    p = torch.softmax(top, dim=-1)
    return -torch.special.xlogy(p, p).sum(dim=-1)
