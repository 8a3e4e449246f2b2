"""Side-effect-free tensor and cost math used by the engine, the sampler and the ledger."""

from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)


def entropy_bits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of ``softmax(logits)`` over the last dimension.

    ``logits``: [..., V] raw logits (before temperature); returns [...] float32.
    ``-inf`` logits (masked tokens) contribute nothing.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [..., V]
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    return -(plogp.sum(dim=-1)) * LOG2E


def apply_temperature(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Scale ``logits`` [..., V] by ``1 / temperature`` (> 0; a float, or a tensor broadcasting against the
    logits such as [B, 1]), after shifting each row's maximum to 0: the same distribution, but a tiny
    temperature cannot overflow to inf (and NaN)."""
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"temperature must be > 0 here, got {temperature}")
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    # a temperature below float32's range divides by 0: the maxima stay 0, the rest go to -inf
    return torch.where(shifted == 0, torch.zeros_like(shifted), shifted / temperature)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of [..., V] (ties at the cut kept), set the rest to -inf.

    ``k <= 0`` or ``k >= V`` leaves the logits unchanged.
    """
    vocab = logits.shape[-1]
    if k <= 0 or k >= vocab:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


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


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p (temperature > 0)."""
    scaled = apply_temperature(logits, temperature)
    scaled = top_k_filter(scaled, top_k)
    scaled = top_p_filter(scaled, top_p)
    return torch.softmax(scaled, dim=-1)


def sample_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """One token id from ``logits`` [V]: argmax when ``temperature == 0``, else a draw.

    Draws happen on the CPU with ``generator`` so that a seed gives the same token on any device.
    """
    if temperature == 0.0:
        return int(torch.argmax(logits).item())
    probs = sampling_probs(logits.float().cpu(), temperature, top_k, top_p)  # [V]
    return int(torch.multinomial(probs, 1, generator=generator).item())


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


def acceptance_probability(target: torch.Tensor, draft: torch.Tensor, token: int) -> float:
    """Speculative sampling's ``min(1, p(x) / q(x))`` for draft token ``x`` (``target``, ``draft``: [V] probs)."""
    q = float(draft[token])
    return 1.0 if q <= 0.0 else min(1.0, float(target[token]) / q)


def residual_probs(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` over [V], the distribution to resample from after a rejection.

    When ``p <= q`` everywhere (only possible if p == q up to rounding) it is ``p`` itself."""
    residual = torch.clamp(target - draft, min=0.0)
    total = residual.sum()
    return target if total <= 0 else residual / total


def without_token(probs: torch.Tensor, token: int) -> torch.Tensor:
    """``probs`` [V] with ``token``'s mass set to zero and the rest renormalised (unchanged if nothing is left)."""
    out = probs.clone()
    out[token] = 0.0
    total = out.sum()
    return probs if total <= 0 else out / total


def top_n_overlap(logits_a: torch.Tensor, logits_b: torch.Tensor, n: int) -> float:
    """``|topN(a) ∩ topN(b)| / n`` for two [V] logit rows."""
    n = min(n, logits_a.shape[-1])
    a = set(torch.topk(logits_a, n).indices.tolist())
    b = set(torch.topk(logits_b, n).indices.tolist())
    return len(a & b) / n


def top_k_entropy_nats(logits: torch.Tensor, k: int = 20) -> torch.Tensor:
    """Entropy in nats of the top-``k`` probabilities of ``softmax(logits)``, renormalised (EAGER's measure)."""
    top = torch.topk(logits.float(), min(k, logits.shape[-1]), dim=-1).values
    logp = torch.log_softmax(top, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear interpolation) of ``values``; -inf when there are none."""
    if not values:
        return -math.inf
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q / 100.0))
