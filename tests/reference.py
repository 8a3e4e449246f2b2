"""A slow, obviously-correct decoder: re-runs the whole prefix on the active model at every step."""

from __future__ import annotations

import torch

from ead_llm.core.loading import ModelPair
from ead_llm.core.ops import entropy_bits
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
