"""Engine behaviour on scripted logits: switching points, catch-up in one pass, and the bill."""

import math

import pytest

from ead_llm.accounting.ledger import Pricing, forward_flops
from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import FinishReason, Role
from ead_llm.policies.base import LargeOnly, SmallOnly
from ead_llm.policies.switching import EAD
from tests.scripted import peaked, scripted_pair

SMALL_TOKEN, LARGE_TOKEN = 10, 20  # '6' and 'g' in the char tokenizer


def make(hard: set[int]):
    """Small is unsure (nearly uniform, still preferring its token) at positions in ``hard``.

    The large model is always sure.
    """

    def small_fn(position: int, history: list[int]):
        return peaked(78, SMALL_TOKEN, 0.5 if position in hard else 30.0)

    def large_fn(position: int, history: list[int]):
        return peaked(78, LARGE_TOKEN, 30.0)

    return scripted_pair(small_fn, large_fn)


def test_ead_switches_at_scripted_points_and_catches_up_in_one_pass() -> None:
    prompt = [1, 5, 6]  # BOS and two characters: positions 0..2
    hard = {5, 6}  # the small model is unsure about the 3rd and 4th generated tokens
    pair, small, large = make(hard)
    engine = Engine(pair)
    policy = EAD(threshold=1.0, window=1, min_dwell=2)
    (done,) = engine.generate([Request(prompt, policy, SamplingParams(max_tokens=9))])
    # t1 S(sure) t2 S(sure) t3 S(unsure: ~6.2 bits) -> decision after t3 (dwell 2 passed): L
    # t4..t5 L (sure, dwell 2) -> decision after t5: S; t6.. S sure
    assert "".join("L" if r is Role.LARGE else "S" for r in done.roles) == "SSSLLSSSS"
    assert done.token_ids == tuple(SMALL_TOKEN if r is Role.SMALL else LARGE_TOKEN for r in done.roles)
    assert math.log2(78) - 0.2 < done.entropies[2] < math.log2(78)
    assert done.entropies[0] < 1e-6
    # small: prefill the prompt, then one token per step, then one pass over the gap L left
    assert small.calls[0] == prompt
    assert [len(c) for c in small.calls] == [3, 1, 1, 3, 1, 1, 1]
    assert small.calls[3] == [SMALL_TOKEN, LARGE_TOKEN, LARGE_TOKEN]
    # large: its first pass covers the prompt and the three small tokens at once
    assert large.calls[0] == [*prompt, SMALL_TOKEN, SMALL_TOKEN, SMALL_TOKEN]
    assert [len(c) for c in large.calls] == [6, 1]
    cost = done.cost
    assert cost.switches == 2
    assert (cost.small_tokens, cost.large_tokens, cost.completion_tokens) == (7, 2, 9)
    assert cost.small_processed_tokens == sum(len(c) for c in small.calls) == 11
    assert cost.large_processed_tokens == sum(len(c) for c in large.calls) == 7


def test_flops_follow_the_forward_passes() -> None:
    pair, small, large = make({4})
    engine = Engine(pair)
    (done,) = engine.generate(
        [Request([1, 5], EAD(threshold=1.0, window=1, min_dwell=1), SamplingParams(max_tokens=6))]
    )
    expected = 0
    for calls in (small.calls, large.calls):
        past = 0
        for call in calls:
            expected += forward_flops(
                new_tokens=len(call),
                past_tokens=past,
                non_embedding_params=100 if calls is small.calls else 1000,
                num_layers=2,
                attention_width=8,
            )
            past += len(call)
    assert done.cost.flops == expected


def test_ledger_invariants_and_prices() -> None:
    pair, _, _ = make({3, 4, 9, 10, 11})
    engine = Engine(pair)
    prices = Pricing(small_input=1.0, small_output=2.0, large_input=10.0, large_output=20.0)
    policy = EAD(threshold=1.0, window=2, min_dwell=1)
    done = engine.generate([Request([1, 5, 6], policy, SamplingParams(max_tokens=12))], pricing=prices)[0]
    c = done.cost
    assert c.small_tokens + c.large_tokens == c.completion_tokens == len(done.token_ids) == 12
    assert c.small_processed_tokens >= c.small_tokens and c.large_processed_tokens >= c.large_tokens
    assert c.large_fraction == c.large_tokens / 12
    assert c.parameter_ratio == pytest.approx(c.large_fraction + (1 - c.large_fraction) * 100 / 1000)
    expected_usd = (
        c.small_processed_tokens * 1.0 + c.small_tokens * 2.0 + c.large_processed_tokens * 10.0 + c.large_tokens * 20.0
    ) / 1e6
    assert c.to_dict()["cost_usd"] == pytest.approx(expected_usd)
    assert "cost_usd" not in engine.generate([Request([1, 5], policy, SamplingParams(max_tokens=2))])[0].cost.to_dict()


def test_single_model_policies_never_touch_the_other_model() -> None:
    pair, small, large = make(set(range(100)))
    engine = Engine(pair)
    engine.generate([Request([1, 5], SmallOnly(), SamplingParams(max_tokens=4))])
    assert large.calls == [] and len(small.calls) == 4
    small.calls.clear()
    done = engine.generate([Request([1, 5], LargeOnly(), SamplingParams(max_tokens=4))])[0]
    assert small.calls == [] and done.cost.small_processed_tokens == 0
    assert done.cost.parameter_ratio == 1.0


def test_eos_ends_the_sequence_and_counts() -> None:
    tokenizer_eos = 2

    def small_fn(position: int, history: list[int]):
        return peaked(78, tokenizer_eos if position == 4 else SMALL_TOKEN, 30.0)

    pair, _, _ = scripted_pair(small_fn, small_fn)
    engine = Engine(pair)
    done = engine.generate([Request([1, 5], SmallOnly(), SamplingParams(max_tokens=10))])[0]
    assert done.token_ids == (SMALL_TOKEN, SMALL_TOKEN, tokenizer_eos)
    assert done.finish_reason is FinishReason.STOP
    assert done.text == "66"
    longer = engine.generate([Request([1, 5], SmallOnly(), SamplingParams(max_tokens=5, ignore_eos=True))])[0]
    assert len(longer.token_ids) == 5 and longer.finish_reason is FinishReason.LENGTH


def test_stop_string_across_tokens_is_cut_and_not_returned() -> None:
    # the small model spells "66g6..." : stop on "6g" spans two tokens
    def small_fn(position: int, history: list[int]):
        return peaked(78, LARGE_TOKEN if position == 4 else SMALL_TOKEN, 30.0)

    pair, _, _ = scripted_pair(small_fn, small_fn)
    engine = Engine(pair)
    done = engine.generate([Request([1, 5], SmallOnly(), SamplingParams(max_tokens=10, stop=("6g",)))])[0]
    assert done.text == "6"
    assert done.finish_reason is FinishReason.STOP
    assert len(done.token_ids) == 3  # the tokens of the stop string were generated (and billed)


def test_lookahead_gives_the_unsure_position_itself_to_the_large_model() -> None:
    prompt = [1, 5, 6]
    hard = {5, 6}  # the small model is unsure about the 3rd and 4th generated tokens
    pair, small, large = make(hard)
    engine = Engine(pair)
    policy = EAD(threshold=1.0, window=1, min_dwell=1, lookahead=True)
    (done,) = engine.generate([Request(prompt, policy, SamplingParams(max_tokens=7))])
    # the small model's distributions at t3 and t4 are unsure: both tokens are withheld and written by L
    assert "".join("L" if r is Role.LARGE else "S" for r in done.roles) == "SSLLSSS"
    assert done.token_ids[2:4] == (LARGE_TOKEN, LARGE_TOKEN)
    assert done.cost.extra["withheld_tokens"] == 2 and done.cost.switches == 2
    # small: prefill, t1, t2, the withheld forward at t3; after L's t3 it reads it and is unsure again
    # (withheld t4); after L's t4 it reads it and goes on
    assert [len(c) for c in small.calls] == [3, 1, 1, 1, 1, 1, 1]
    assert small.calls[3] == [LARGE_TOKEN] and small.calls[4] == [LARGE_TOKEN]
    # large: catches up over the prompt and two small tokens to write t3, then writes t4 from t3
    assert large.calls == [[*prompt, SMALL_TOKEN, SMALL_TOKEN], [LARGE_TOKEN]]
    assert done.cost.small_processed_tokens == sum(len(c) for c in small.calls)
    assert done.cost.large_processed_tokens == 6
    # standard EAD with the same settings writes the unsure tokens with the small model
    pair, _, _ = make(hard)
    (plain,) = Engine(pair).generate([Request(prompt, EAD(1.0, 1, 1), SamplingParams(max_tokens=7))])
    assert "".join("L" if r is Role.LARGE else "S" for r in plain.roles) == "SSSLSSS"  # t3 is the small model's


def test_the_first_event_reports_the_prompt_once() -> None:
    pair, _, _ = make(set())
    events = list(Engine(pair).stream([Request([1, 5, 6], SmallOnly(), SamplingParams(max_tokens=4))]))
    assert [e.prompt_tokens for e in events] == [3, 0, 0, 0]
