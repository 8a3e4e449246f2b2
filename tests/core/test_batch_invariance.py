"""Batch invariance: a request's every number (tokens, entropies, the large model's hidden states) is the same bits
alone and beside other requests, whatever rows share its passes and wherever its blocks lie.

Prefix caching is off here: a prompt whose first blocks were cached by an earlier call attends its remaining
positions over the cached keys, where the first call ran one causal pass over the whole prompt; the two sum in
another order (the last bits of its logits differ, its text almost never). That is a known limit, not covered."""

from __future__ import annotations

import pytest
import torch

from ead_llm import EAD, EASD, LargeOnly, SpeculativeDecoding
from ead_llm.core import model_runner
from ead_llm.core.engine import Engine
from ead_llm.core.loading import ModelPair
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.policies.base import Policy

POLICIES = [
    LargeOnly(),
    EAD(threshold=0.3),
    SpeculativeDecoding(gamma=3),
    SpeculativeDecoding(),
    EASD(gamma=3, entropy_threshold=0.5),
]


def _same(a: Completion, b: Completion) -> None:
    assert a.token_ids == b.token_ids and a.roles == b.roles
    assert a.entropies == b.entropies  # floats compared exactly
    assert a.hidden_states is not None and b.hidden_states is not None
    torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name + ("_adaptive" if p.name == "speculative" else ""))
@pytest.mark.parametrize("view_min", [512, 24], ids=["short-rows", "long-rows-in-pieces"])
@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
def test_a_requests_numbers_are_the_same_bits_alone_and_in_a_batch(
    llama_pair: ModelPair, policy: Policy, view_min: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five prompts of several lengths, sampled at temperature 1: each alone, then all five in one call (their
    passes shared, their blocks interleaved), then in the other order. With VIEW_MIN 24 and pieces of 16 positions,
    most rows are attended alone in pieces, some copied, some over views. torch runs 1 or 2 threads."""
    monkeypatch.setattr(model_runner, "VIEW_MIN", view_min)
    monkeypatch.setattr(model_runner, "SPLIT", 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # before the engine's thread starts, which takes the setting then
    engine = Engine(llama_pair, return_hidden_states=True)
    engine.prefix_caching = False  # a hit changes how a prompt's last positions are attended: see the docstring
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, llama_pair.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 30, 44, 9)]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    try:
        alone = [engine.generate([Request(p, policy, params)])[0] for p in prompts]
        together = engine.generate([Request(p, policy, params) for p in prompts])
        backwards = engine.generate([Request(p, policy, params) for p in reversed(prompts)])[::-1]
    finally:
        engine.close()
        torch.set_num_threads(before)
    for a, b, c in zip(alone, together, backwards, strict=True):
        _same(a, b)
        _same(a, c)
