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


def top_p_filter(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus filter on [..., V]: keep the smallest set of most likely tokens whose mass >= ``p`` (a float,
    or per row a tensor such as [B, 1]).

    The most likely token is always kept; ``p >= 1`` leaves the logits unchanged.
    """
    if isinstance(p, (int, float)) and p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [..., V]
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


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
