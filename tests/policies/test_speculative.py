"""Speculative decoding and EASD: lossless output, rollback, the rejection rule, the bill."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ead_llm import EASD, EntropyAdaptiveLLM, LargeOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.evaluation.task import problems
from ead_llm.policies.speculative import acceptance_rate, best_gamma
from tests.scripted import scripted_pair

VOCAB = 78  # the scripted pair's char tokenizer


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gamma": 0}, "gamma"),
        ({"gamma": 8, "max_gamma": 4}, "max_gamma"),
        ({"entropy_threshold": -1.0}, "entropy_threshold"),
        ({"top_n": 0}, "top_n"),
        ({"overlap_threshold": 1.5}, "overlap_threshold"),
        ({"stop_entropy": -0.5}, "stop_entropy"),
        ({"stop_entropy": float("nan")}, "stop_entropy"),
    ],
)
def test_bad_settings_name_the_parameter(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EASD(**kwargs)


def test_best_gamma_weighs_tokens_against_cost() -> None:
    """Tokens per unit of cost, ``(1 + a + ... + a**g) / (1 + g c)``, worked by hand for a few cases."""
    assert best_gamma(0.0, 0.1, 16) == 1 and best_gamma(1.0, 0.1, 16) == 16 and best_gamma(1.0, 0.1, 5) == 5
    # a = 0.5, c = 0.06: g = 2 gives 1.75 / 1.12 = 1.5625, g = 3 gives 1.875 / 1.18 = 1.589, g = 4 1.9375 / 1.24
    assert best_gamma(0.5, 0.06, 16) == 3
    assert best_gamma(0.5, 0.0, 16) == 16  # free drafts: as many as allowed
    chosen = [best_gamma(a / 20, 0.1, 16) for a in range(20)]
    assert chosen == sorted(chosen)  # more acceptance, never fewer drafts


def test_adaptive_gamma_follows_the_recent_acceptance_within_bounds() -> None:
    policy = SpeculativeDecoding(gamma=2, adaptive_gamma=True, max_gamma=6, draft_cost=0.1)
    state = policy.begin_round(policy.start(), budget=10)
    assert state.gamma == 2 and state.drafted == 0
    for _ in range(8):  # every draft stands: the estimate climbs and the rounds grow to the bound
        state = policy.begin_round(policy.end_round(state, drafted=state.gamma, accepted=state.gamma), budget=100)
    assert state.gamma == 6
    sizes = []
    for _ in range(16):  # every first draft falls: down to one draft a round (the estimate forgets the sweeps)
        state = policy.begin_round(policy.end_round(state, drafted=state.gamma, accepted=0), budget=100)
        sizes.append(state.gamma)
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 1
    assert policy.begin_round(replace(state, next_gamma=5), budget=1).gamma == 1  # the length budget caps a round
    rate = acceptance_rate(state.stood, state.judged)
    assert 0.0 < rate < 0.25
    fixed = SpeculativeDecoding(gamma=3)
    assert fixed.end_round(fixed.begin_round(fixed.start(), 10), drafted=3, accepted=0).next_gamma == 3


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_output_equals_large_only_on_tiny_pairs(pair, gamma: int) -> None:
    engine = Engine(pair)
    prompts = ["12+35=", "7*8=", "The quick brown", "a", "x=1\ny=", "99+1="]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    large = engine.generate([Request(p, LargeOnly(), params) for p in prompts])
    for policy in (SpeculativeDecoding(gamma=gamma), SpeculativeDecoding(gamma=gamma, adaptive_gamma=True)):
        spec = engine.generate([Request(p, policy, params) for p in prompts])
        assert [c.token_ids for c in spec] == [c.token_ids for c in large]
        for c in spec:
            extra = c.cost.extra
            assert extra["drafted_tokens"] >= extra["accepted_tokens"] >= 0
            assert c.cost.small_tokens == extra["accepted_tokens"] and c.cost.completion_tokens == 30


def test_greedy_output_equals_large_only_on_the_embedded_pair() -> None:
    llm = EntropyAdaptiveLLM(max_tokens=400)
    prompts = [p.prompt for p in problems("test", 24)]
    large = llm.batch(prompts, policy=LargeOnly())
    for gamma in (2, 4, 8):
        assert llm.batch(prompts, policy=SpeculativeDecoding(gamma=gamma)) == large
    assert llm.batch(prompts, policy=EASD(entropy_threshold=math.inf)) == large


def _fixed(support: dict[int, float]):
    logits = torch.full((VOCAB,), -1e4)
    for token, probability in support.items():
        logits[token] = math.log(probability)
    return lambda position, history: logits


def test_first_token_follows_the_large_model_distribution() -> None:
    p_large = {10: 0.5, 11: 0.3, 12: 0.15, 13: 0.05}
    p_small = {10: 0.2, 11: 0.5, 12: 0.05, 14: 0.25}  # 14 is a token the large model never writes
    pair, _, _ = scripted_pair(_fixed(p_small), _fixed(p_large))
    engine = Engine(pair, max_batch=256)
    runs = 3000
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=11)
    requests = [Request([1, 5], SpeculativeDecoding(gamma=3), params, sample_index=k) for k in range(runs)]
    counts = dict.fromkeys(range(VOCAB), 0)
    for completion in engine.generate(requests):
        for token in completion.token_ids:
            counts[token] += 1
    total = runs * 4
    chi_square = sum((counts[t] - total * p) ** 2 / (total * p) for t, p in p_large.items())
    assert counts[14] == 0  # never emitted, though the small model drafts it a quarter of the time
    assert chi_square < 16.27  # 3 degrees of freedom, p = 0.001
    tv = 0.5 * sum(abs(counts[t] / total - p) for t, p in p_large.items())
    assert tv < 0.02


def test_easd_with_infinite_threshold_is_speculative_decoding(pair) -> None:
    engine = Engine(pair)
    params = SamplingParams(max_tokens=25, temperature=0.9, seed=4)
    prompts = ["12+35=", "The quick", "x"]
    spec = engine.generate([Request(p, SpeculativeDecoding(gamma=3), params) for p in prompts])
    easd = engine.generate([Request(p, EASD(entropy_threshold=math.inf, gamma=3), params) for p in prompts])
    assert [c.token_ids for c in easd] == [c.token_ids for c in spec]
    assert all(c.cost.extra["entropy_rejections"] == 0 for c in easd)


def _uncertain_at(hard: set[int]):
    """Both models prefer token 10; at ``hard`` positions both are unsure over tokens 10..17 (3 bits),
    the large model's second choice being 11; elsewhere both are sure."""

    def make(second: int):
        def logits_fn(position: int, history: list[int]) -> torch.Tensor:
            logits = torch.full((VOCAB,), -1e4)
            if position in hard:
                logits[10:18] = 0.0
                logits[10] = 0.02
                logits[second] = 0.01
            else:
                logits[10] = 0.0
            return logits

        return logits_fn

    return scripted_pair(make(12), make(11))


def test_the_easd_rule_fires_exactly_on_uncertain_agreement() -> None:
    hard = {4, 7}  # the 3rd and 6th generated tokens (prompt of two: positions 0-1)
    pair, small, large = _uncertain_at(hard)
    engine = Engine(pair)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    (plain,) = engine.generate([Request([1, 5], SpeculativeDecoding(gamma=4), params)])
    assert plain.token_ids == (10,) * 8 and plain.cost.extra["entropy_rejections"] == 0
    small.calls.clear()
    large.calls.clear()
    (done,) = engine.generate([Request([1, 5], EASD(gamma=4, entropy_threshold=2.0, top_n=8), params)])
    # at each hard position the draft (10) would stand, but both models are at 3 bits and agree on the
    # top-8: rejected, and the large model's best other token (11) is written instead
    assert done.token_ids == (10, 10, 11, 10, 10, 11, 10, 10)
    assert [r is Role.LARGE for r in done.roles][2] and done.cost.extra["entropy_rejections"] == 2
    (strict,) = engine.generate([Request([1, 5], EASD(gamma=4, entropy_threshold=3.5, top_n=8), params)])
    assert strict.cost.extra["entropy_rejections"] == 0  # 3 bits is not above 3.5
    (apart,) = engine.generate([Request([1, 5], EASD(gamma=4, top_n=2, overlap_threshold=0.5), params)])
    assert apart.cost.extra["entropy_rejections"] == 0  # top-2 sets {10,12} and {10,11} share only half


def test_rejected_drafts_are_billed_and_rolled_back() -> None:
    hard = {4}
    pair, small, large = _uncertain_at(hard)
    engine = Engine(pair)
    (done,) = engine.generate([Request([1, 5], EASD(gamma=4, top_n=8), SamplingParams(max_tokens=6, ignore_eos=True))])
    cost = done.cost
    assert cost.small_processed_tokens == sum(len(c) for c in small.calls)
    assert cost.large_processed_tokens == sum(len(c) for c in large.calls)
    # round 1: drafts t1..t4, t3 rejected -> t1 t2 stand, 11 written; the large model read prompt + 4 drafts
    assert large.calls[0] == [1, 5, 10, 10, 10, 10]
    # round 2 starts from what stood: the large model re-reads only its own token and the new drafts
    assert large.calls[1][0] == 11 and len(large.calls[1]) == 1 + cost.extra["drafted_tokens"] - 4
    assert cost.extra["drafted_tokens"] > cost.extra["accepted_tokens"]
    assert cost.to_dict()["acceptance_rate"] == pytest.approx(
        cost.extra["accepted_tokens"] / cost.extra["drafted_tokens"]
    )


def test_policy_overrides_reach_speculative_decoding_through_the_llm() -> None:
    llm = EntropyAdaptiveLLM(max_tokens=200)
    prompt = problems("test", 1)[0].prompt
    result = llm.generate([prompt], policy=SpeculativeDecoding(gamma=4))
    cost = result.llm_output["cost"]  # type: ignore[index]
    assert result.generations[0][0].text == llm.invoke(prompt, policy=LargeOnly())
    assert {"drafted_tokens", "accepted_tokens", "entropy_rejections", "acceptance_rate"} <= set(cost)
    chunks = list(llm.stream(prompt, policy=EASD()))
    assert "".join(chunks) == result.generations[0][0].text


def test_drafting_stops_at_an_end_of_text_draft() -> None:
    eos = 2

    def small_fn(position: int, history: list[int]) -> torch.Tensor:
        logits = torch.full((VOCAB,), -1e4)
        logits[eos if position == 4 else 10] = 0.0
        return logits

    def large_fn(position: int, history: list[int]) -> torch.Tensor:
        logits = torch.full((VOCAB,), -1e4)
        logits[10] = 0.0
        return logits

    pair, _, large = scripted_pair(small_fn, large_fn)
    assert pair.eos_token_ids == frozenset({eos})
    (done,) = Engine(pair).generate([Request([1, 5], SpeculativeDecoding(gamma=6), SamplingParams(max_tokens=8))])
    # the third draft is EOS: the round ends there and is verified (the large model writes 10 instead)
    assert large.calls[0] == [1, 5, 10, 10, eos]
    assert done.cost.extra["drafted_tokens"] >= 3 and done.token_ids[:3] == (10, 10, 10)


def test_a_round_ends_after_a_draft_the_small_model_was_unsure_of() -> None:
    """stop_entropy: the second draft is drawn at 3 bits, so with a 2-bit stop the round is verified there (the
    large model reads two drafts, not four); the text is LargeOnly's either way, and a sure draft never stops it."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for stop, first_read in ((2.0, [1, 5, 10, 10]), (3.5, [1, 5, 10, 10, 10, 10]), (math.inf, [1, 5, 10, 10, 10, 10])):
        pair, _, large = _uncertain_at({3})
        (done,) = Engine(pair).generate([Request([1, 5], SpeculativeDecoding(gamma=4, stop_entropy=stop), params)])
        assert large.calls[0] == first_read, stop
        assert done.token_ids == (10,) * 8
        assert done.cost.extra["drafted_tokens"] == done.cost.extra["accepted_tokens"]
