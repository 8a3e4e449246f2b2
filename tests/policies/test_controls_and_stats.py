"""Control policies (random and fixed-block switching) and the statistics for comparisons."""

from __future__ import annotations

import math

import pytest
import torch

from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.evaluation.stats import mcnemar_exact, wilson_interval
from ead_llm.policies.base import describe_policy, policy_from_description
from ead_llm.policies.controls import FixedBlockSwitching, RandomSwitching, block_draw


def _roles(policy, tokens: int, key: int = 0) -> str:
    state = policy.start_sequence(key)
    out = []
    for _ in range(tokens):
        role = policy.choose(state)
        out.append("L" if role is Role.LARGE else "S")
        state = policy.advance(state, role, 0.0)
    return "".join(out)


def test_fixed_block_rhythm() -> None:
    assert _roles(FixedBlockSwitching(small_block=3, large_block=2), 12) == "SSSLLSSSLLSS"
    assert FixedBlockSwitching(small_block=3, large_block=1).large_fraction == 0.25
    with pytest.raises(ValueError, match="both be 0"):
        FixedBlockSwitching(small_block=0, large_block=0)


def test_random_switching_hits_its_fraction_in_blocks_and_repeats() -> None:
    policy = RandomSwitching(fraction=0.3, block=5, seed=7)
    pattern = _roles(policy, 20_000)
    assert all(len(set(pattern[i : i + 5])) == 1 for i in range(0, 20_000, 5))  # whole blocks
    assert abs(pattern.count("L") / 20_000 - 0.3) < 0.02
    assert _roles(policy, 200) == pattern[:200] and _roles(RandomSwitching(0.3, 5, seed=8), 200) != pattern[:200]
    assert (
        _roles(RandomSwitching(fraction=0.0), 50) == "S" * 50 and _roles(RandomSwitching(fraction=1.0), 50) == "L" * 50
    )
    assert _roles(policy, 200, key=1) != pattern[:200]  # each sequence has its own pattern
    assert 0.0 <= block_draw(0, 0, 0) < 1.0
    for bad, match in (({"fraction": 1.5}, "fraction"), ({"block": 0}, "block"), ({"seed": -1}, "seed")):
        with pytest.raises(ValueError, match=match):
            RandomSwitching(**bad)


def test_controls_run_on_the_engine_and_round_trip(llama_pair) -> None:
    engine = Engine(llama_pair)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    (done,) = engine.generate([Request("12+35=", FixedBlockSwitching(small_block=6, large_block=2), params)])
    assert "".join("L" if r is Role.LARGE else "S" for r in done.roles) == ("S" * 6 + "L" * 2) * 5
    assert done.cost.large_tokens == 10 and done.cost.switches == 9
    for policy in (RandomSwitching(0.2, 4, 3), FixedBlockSwitching(5, 1)):
        assert policy_from_description(describe_policy(policy)) == policy


def test_random_switching_pattern_is_per_sequence_and_batch_independent(llama_pair) -> None:
    engine = Engine(llama_pair)
    policy = RandomSwitching(fraction=0.5, block=3, seed=1)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = ["12+35=", "a+b=", "x=1\ny=", "99+1=", "7*8="]
    together = engine.generate([Request(p, policy, params) for p in prompts])
    alone = [engine.generate([Request(p, policy, params)])[0] for p in prompts]
    assert [c.roles for c in together] == [c.roles for c in alone]
    assert len({c.roles for c in together}) == len(prompts)  # five different patterns
    large = sum(c.cost.large_tokens for c in together) / sum(c.cost.completion_tokens for c in together)
    assert 0.25 < large < 0.75


def test_wilson_interval_against_hand_computed_values() -> None:
    # 45 of 100, z = 1.959964 (z^2 = 3.841459): centre (.45 + .0192073) / 1.0384146 = .451850,
    # half 1.959964 * sqrt(.002475 + .0000960365) / 1.0384146 = .095704
    low, high = wilson_interval(45, 100)
    assert low == pytest.approx(0.356146, abs=2e-6) and high == pytest.approx(0.547554, abs=2e-6)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(5, 3)


def test_mcnemar_against_hand_computed_values() -> None:
    a = [True] * 10 + [False] * 2 + [True] * 5
    b = [False] * 10 + [True] * 2 + [True] * 5
    only_a, only_b, p = mcnemar_exact(a, b)
    # 10 vs 2 discordant: 2 * P(X <= 2), X ~ Bin(12, .5) = 2 * (1 + 12 + 66) / 4096 = 0.0385742
    assert (only_a, only_b) == (10, 2) and p == pytest.approx(158 / 4096)
    assert mcnemar_exact([True, False], [True, False]) == (0, 0, 1.0)
    assert mcnemar_exact([True], [False])[2] == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        mcnemar_exact([True], [True, False])


def test_oracle_uses_the_large_model_exactly_where_top1_differs(pair) -> None:
    engine = Engine(pair)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = ["12+35=", "The quick", "x=1\ny="]
    _check_oracle(engine, prompts, params)


def test_oracle_on_the_embedded_pair_where_the_models_mostly_agree() -> None:
    from ead_llm import EntropyAdaptiveLLM
    from ead_llm.evaluation.task import problems

    engine = EntropyAdaptiveLLM().shared_engine
    fractions = _check_oracle(engine, [p.prompt for p in problems("test", 6)], SamplingParams(max_tokens=400))
    assert 0.0 < max(fractions) < 0.3  # the small model's top-1 is usually the large model's


def _check_oracle(engine: Engine, prompts: list[str], params: SamplingParams) -> list[float]:
    from ead_llm import LargeOnly
    from ead_llm.policies.controls import OracleSwitching

    large = engine.generate([Request(p, LargeOnly(), params) for p in prompts])
    oracle = engine.generate([Request(p, OracleSwitching(), params) for p in prompts])
    assert [c.token_ids for c in oracle] == [c.token_ids for c in large]  # greedy: the large model's text
    small = engine.pair.small.model
    for completion, prompt in zip(oracle, prompts, strict=True):
        # replay without any cache: the small model's top-1 at each position, against the token written there
        ids = engine.encode(prompt) + list(completion.token_ids)
        with torch.inference_mode():
            logits = small(input_ids=torch.tensor([ids[:-1]])).logits[0, :, : engine.pair.vocab_size]  # [T, V]
        small_top1 = logits.argmax(-1).tolist()[-len(completion.token_ids) :]
        expected = ["S" if s == t else "L" for s, t in zip(small_top1, completion.token_ids, strict=True)]
        assert ["S" if r is Role.SMALL else "L" for r in completion.roles] == expected
    with pytest.raises(ValueError, match="gamma must be 1"):
        OracleSwitching(gamma=2)
    return [c.cost.large_fraction for c in oracle]


def test_query_router_routes_the_whole_call_after_its_probe() -> None:
    """The small model writes the probe; the probe's mean entropy, strictly above the threshold, sends every
    later token to the large model, else every later one stays small; nothing after the probe changes it."""
    from ead_llm.policies.controls import QueryRouter

    def roles(policy: QueryRouter, entropies: list[float]) -> str:
        state, out = policy.start(), []
        for entropy in entropies:
            role = policy.choose(state)
            out.append("L" if role is Role.LARGE else "S")
            state = policy.advance(state, role, entropy)
        return "".join(out)

    router = QueryRouter(threshold=1.0, probe=3)
    assert roles(router, [2.0, 1.0, 0.5, 0, 0, 0]) == "SSSLLL"  # mean 7/6 > 1
    assert roles(router, [1.0, 1.0, 1.0, 9, 9, 9]) == "SSSSSS"  # mean 1 is not above 1; later entropy is ignored
    assert roles(QueryRouter(threshold=math.inf, probe=1), [50.0] * 4) == "SSSS"
    assert policy_from_description(describe_policy(router)) == router
    for bad, match in (({"threshold": -1}, "threshold"), ({"probe": 0}, "probe")):
        with pytest.raises(ValueError, match=match):
            QueryRouter(**bad)


def test_query_router_on_the_engine_with_engineered_entropies() -> None:
    """On a scripted pair whose small model is unsure (uniform) or sure (peaked), the call goes to the large
    model after the probe, or stays on the small one, as a whole."""
    from ead_llm.policies.controls import QueryRouter
    from tests.scripted import peaked, scripted_pair

    for sharpness, want in ((0.0, "S" * 4 + "L" * 8), (30.0, "S" * 12)):
        pair, _, _ = scripted_pair(lambda p, s, k=sharpness: peaked(40, 7, k), lambda p, s: peaked(40, 9, 30.0))
        engine = Engine(pair)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        (done,) = engine.generate([Request([5, 6], QueryRouter(threshold=1.0, probe=4), params)])
        assert "".join("L" if r is Role.LARGE else "S" for r in done.roles) == want
        assert done.cost.switches == (1 if "L" in want else 0)
        engine.close()
