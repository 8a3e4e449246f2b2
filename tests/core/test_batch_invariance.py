"""Batch invariance: a request's every number (tokens, entropies, the large model's hidden states) is the same bits
alone and beside other requests, whatever rows share its passes and wherever its blocks lie. Prefix caching is on:
the later calls find the first calls' prompts cached (tests/core/test_prefix_cache.py tries the hits themselves)."""

from __future__ import annotations

import pytest
import torch

from ead_llm import EAD, EASD, LargeOnly, SpeculativeDecoding
from ead_llm.core import frontend, model_runner
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
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, llama_pair.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 30, 44, 9)]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    try:
        alone = [engine.generate([Request(p, policy, params)])[0] for p in prompts]
        together = engine.generate([Request(p, policy, params) for p in prompts])
        backwards = engine.generate([Request(p, policy, params) for p in reversed(prompts)])[::-1]
        assert all(r.retried_passes == 0 for r in engine.runners.values())  # no pass failed and was bisected
    finally:
        engine.close()
        torch.set_num_threads(before)
    for a, b, c in zip(alone, together, backwards, strict=True):
        _same(a, b)
        _same(a, c)


@pytest.mark.parametrize("view_min", [512, 24], ids=["short-rows", "long-rows-in-pieces"])
@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
def test_a_verification_computes_every_position_as_a_decode_step_would(
    llama_pair: ModelPair, view_min: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``exact_verification``, greedy speculative decoding is LargeOnly to the last bit: the large model's hidden
    state at every position it was fed is the same whether the position came in a verification of several drafts
    (or after the prompt, in its first pass) or in a one-token decode step, so no near-tie can turn a
    verification's argmax away from LargeOnly's. Four prompts, alone and in one call; the random pair agrees on few
    drafts, so most rounds reject some. (Without it the hidden states differ in the last bits.)"""
    monkeypatch.setattr(model_runner, "VIEW_MIN", view_min)
    monkeypatch.setattr(model_runner, "SPLIT", 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = Engine(llama_pair, return_hidden_states=True, exact_verification=True)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, llama_pair.vocab_size, (n,), generator=gen).tolist() for n in (6, 19, 33, 47)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    try:
        runs = {
            policy.name + str(i): [engine.generate([Request(p, policy, params)])[0] for p in prompts]
            + engine.generate([Request(p, policy, params) for p in prompts])
            for i, policy in enumerate([LargeOnly(), SpeculativeDecoding(gamma=3), SpeculativeDecoding(gamma=7)])
        }
        assert all(r.retried_passes == 0 for r in engine.runners.values())  # no pass failed and was bisected
    finally:
        engine.close()
        torch.set_num_threads(before)
    reference = runs.pop("large_only0")
    for name, completions in runs.items():
        for ref, got in zip(reference, completions, strict=True):
            assert got.token_ids == ref.token_ids, name
            assert ref.hidden_states is not None and got.hidden_states is not None
            fed = ~torch.isnan(got.hidden_states[:, 0])  # positions the large model read (its last ones may lag)
            assert fed.sum() >= len(ref.hidden_states) - 8, name
            torch.testing.assert_close(got.hidden_states[fed], ref.hidden_states[fed], rtol=0, atol=0)


def test_exact_verification_follows_the_large_models_size_unless_told_and_takes_a_bool_only(
    llama_pair: ModelPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(llama_pair)  # a tiny large model: off
    assert engine.exact_verification is False and not any(r.exact_verification for r in engine.runners.values())
    engine.exact_verification = True
    assert all(r.exact_verification is True for r in engine.runners.values())
    with pytest.raises(ValueError, match="exact_verification must be True or False"):
        engine.exact_verification = "yes"  # type: ignore[assignment]
    assert engine.exact_verification is True  # the refused value changed nothing
    with pytest.raises(ValueError, match="exact_verification must be True or False"):
        Engine(llama_pair, exact_verification=1)  # type: ignore[arg-type]
    large = sum(p.numel() for p in llama_pair.large.model.parameters())
    monkeypatch.setattr(frontend, "EXACT_MIN_PARAMETERS", large)  # as large as the threshold: on
    assert Engine(llama_pair).exact_verification is True
    assert Engine(llama_pair, exact_verification=False).exact_verification is False
    monkeypatch.setattr(frontend, "EXACT_MIN_PARAMETERS", large + 1)
    assert Engine(llama_pair).exact_verification is False


@pytest.mark.parametrize(
    "policy", [LargeOnly(), SpeculativeDecoding(gamma=3), EAD(threshold=0.3)], ids=lambda p: p.name
)
def test_a_preempted_request_gets_the_same_bits_under_exact_verification(llama_pair: ModelPair, policy: Policy) -> None:
    """A request preempted under a tight KV budget is fed again from its start: its prompt causally and each token it
    had generated as a decode step, as they were first computed, so its numbers are the bits it gets alone (where
    its prompt's first blocks are still cached, over them). Without exact verification the generated positions
    round as a prefill's and the hidden states differ."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, llama_pair.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 13, 7, 11, 6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=5)
    alone = Engine(llama_pair, kv_block_size=8, return_hidden_states=True, exact_verification=True)
    tight = Engine(
        llama_pair,
        max_batch=6,
        kv_budget_tokens=10 * 8,
        kv_block_size=8,
        return_hidden_states=True,
        exact_verification=True,
    )
    try:
        expected = [alone.generate([Request(p, policy, params)])[0] for p in prompts]
        done = tight.generate([Request(p, policy, params) for p in prompts])
        assert tight.scheduler.preemptions > 0
    finally:
        alone.close()
        tight.close()
    for a, b in zip(expected, done, strict=True):
        _same(a, b)
