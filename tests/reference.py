"""A slow, obviously-correct decoder: re-runs the whole prefix on the active model at every step."""

from __future__ import annotations

import torch

from ead_llm.core.loading import ModelPair
from ead_llm.core.ops import NUCLEUS_RTOL, entropy_bits
from ead_llm.core.types import Role
from ead_llm.policies.base import Policy


@torch.inference_mode()
def reference_greedy(
    pair: ModelPair, prompt_ids: list[int], policy: Policy, max_tokens: int
) -> tuple[list[int], list[Role], list[float]]:
    """Greedy tokens, roles and entropies, with no KV cache at all."""
    tokens = list(prompt_ids)
    state = policy.start()
    out: list[int] = []
    roles: list[Role] = []
    entropies: list[float] = []
    for _ in range(max_tokens):
        role = policy.choose(state)
        model = pair.model(role).model
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1, : pair.vocab_size].float()
        entropy = float(entropy_bits(logits))
        token = int(torch.argmax(logits))
        state = policy.advance(state, role, entropy)
        tokens.append(token)
        out.append(token)
        roles.append(role)
        entropies.append(entropy)
        if token in pair.eos_token_ids:
            break
    return out, roles, entropies


def _top_p_terms(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One row's scaled values ``z``, what top-k keeps, the kept float32 weights as float64 and the nucleus's
    threshold on the mass (``top_p`` as the sampler holds it, in float32, less :data:`NUCLEUS_RTOL`)."""
    z = (logits.float() - logits.float().max()) / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < len(z):
        kth = sorted(z.tolist(), reverse=True)[top_k - 1]
        keep = z >= kth
    w = torch.where(keep, torch.exp(z), 0.0).double()
    threshold = float(torch.tensor(top_p, dtype=torch.float32)) * float(w.sum()) * (1.0 - NUCLEUS_RTOL)
    return z, keep, w, threshold


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution one row ``[V]`` must be drawn from, written out plainly (one step per distinct value): the
    row's float32 weights after temperature (``exp`` of the maximum-shifted logits over ``temperature``, as the
    sampler computes them), summed in float64; top-k keeps every token at least as likely as the k-th; top-p then
    keeps every token whose strictly more likely (kept) tokens hold less than ``top_p`` (float32, as the sampler holds
    it) of the kept mass, mass within :data:`~ead_llm.core.ops.NUCLEUS_RTOL` of it counting as reaching it (the
    sampler's documented edge: with float32 weights an edge on a token would be decided by rounding)."""
    z, keep, w, threshold = _top_p_terms(logits, temperature, top_k, top_p)
    if top_p < 1.0:
        for value in set(z[keep].tolist()):
            strictly_more_likely = float(w[z > value].sum())
            if strictly_more_likely >= threshold:
                keep &= z != value
        w = torch.where(keep, w, 0.0)
    return (w / w.sum()).float()


def rounding_edge(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, rel: float = 1e-5
) -> torch.Tensor:
    """The tokens of one row ``[V]`` whose place in :func:`reference_probs`' nucleus is decided by rounding: those
    whose strictly more likely (kept) tokens' mass lies within ``rel`` of the kept mass from the nucleus's threshold.
    A filter that sums the same float32 weights in another order, or computes them with another ``exp`` a unit in
    the last place apart (the native nucleus: eight-lane float32 sums, its own ``exp``), may decide those the other
    way; every other token it must decide as the reference does."""
    z, keep, w, threshold = _top_p_terms(logits, temperature, top_k, top_p)
    edge = torch.zeros_like(keep)
    if top_p < 1.0:
        total = float(w.sum())
        for value in set(z[keep].tolist()):
            if abs(float(w[z > value].sum()) - threshold) <= rel * total:
                edge |= keep & (z == value)
    return edge
