"""Automatic prefix caching in the engine: a prompt that starts like an earlier one takes the cached blocks instead
of computing them, with the same tokens, whatever the policy, the KV budget or the paths; the bill says so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ead_llm import EAD, EAGER, LargeOnly, SpeculativeDecoding
from ead_llm.accounting.ledger import Pricing
from ead_llm.core.engine import Engine
from ead_llm.core.loading import ModelPair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.policies.base import Policy

SHARED = "".join(f"{a}+{b}=" for a, b in zip(range(10, 40), range(40, 70), strict=True))  # a long common start
PROMPTS = [SHARED + f"{a}+{a}=" for a in range(11, 15)]
POLICIES = {
    "large_only": LargeOnly(),
    "ead": EAD(threshold=0.2, window=3, min_dwell=3),
    "speculative": SpeculativeDecoding(gamma=3),
    "eager": EAGER(theta=0.2, max_paths=3, temperature=0.0),
}


def run(engine: Engine, policy: Policy, prompts: list[str] = PROMPTS, max_tokens: int = 24) -> list:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return engine.generate([Request(p, policy, sampling) for p in prompts])


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_cached_prefix_gives_the_same_tokens_for_less_work(llama_pair, name: str) -> None:
    policy = POLICIES[name]
    plain = Engine(llama_pair)
    plain.prefix_caching = False
    expected = run(plain, policy)
    assert all(c.cost.large_cached_tokens == c.cost.small_cached_tokens == 0 for c in expected)
    engine = Engine(llama_pair)
    first, second = run(engine, policy), run(engine, policy)
    for got in (first, second):
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert [c.roles for c in got] == [c.roles for c in expected]
    processed = [sum(c.cost.large_processed_tokens + c.cost.small_processed_tokens for c in r) for r in (first, second)]
    assert processed[1] < processed[0]
    assert all(c.cost.large_cached_tokens >= len(SHARED) // 2 for c in second)


def test_cached_positions_pay_their_own_price(llama_pair) -> None:
    """Left unpriced, a cached position pays the input price, so the bill is the same with a cold or a warm cache;
    priced, it pays exactly that price instead (and each model's count is in the cost dict)."""
    engine = Engine(llama_pair)
    sampling = SamplingParams(max_tokens=6, temperature=0.0)
    requests = [Request(PROMPTS[0], SpeculativeDecoding(gamma=3), sampling)]
    same = Pricing(small_input=3.0, large_input=7.0, small_output=5.0, large_output=11.0)
    cold = engine.generate(requests, pricing=same)[0].cost
    warm = engine.generate(requests, pricing=same)[0].cost
    assert cold.large_cached_tokens == 0 < warm.large_cached_tokens and warm.small_cached_tokens > 0
    assert warm.cost_usd == pytest.approx(cold.cost_usd)
    cheap = dataclasses.replace(same, large_cached_input=0.5, small_cached_input=0.0)
    priced = engine.generate(requests, pricing=cheap)[0].cost
    assert priced.large_cached_tokens == warm.large_cached_tokens
    saving = (warm.large_cached_tokens * (7.0 - 0.5) + warm.small_cached_tokens * 3.0) / 1e6
    assert priced.cost_usd == pytest.approx(cold.cost_usd - saving)
    assert {"small_cached_tokens", "large_cached_tokens"} <= set(priced.to_dict())
    with pytest.raises(ValueError, match="large_cached_input"):
        Pricing(large_cached_input=-1.0)


def test_a_tight_budget_evicts_cached_blocks_and_keeps_the_tokens(llama_pair) -> None:
    expected = run(Engine(llama_pair), LargeOnly(), max_tokens=40)
    tight = Engine(llama_pair, max_batch=4, kv_budget_tokens=400)  # the four prompts and answers barely fit
    for _ in range(3):  # cached blocks are taken back for running sequences, which may also be preempted
        got = run(tight, LargeOnly(), max_tokens=40)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    cache = tight.caches[Role.LARGE]
    assert cache.pool.max_blocks is not None and cache.pool.used == 0
    assert cache.pool.available() == cache.pool.max_blocks  # idle cached blocks count as available


def test_turning_it_off_forgets_the_cache(llama_pair) -> None:
    engine = Engine(llama_pair)
    run(engine, LargeOnly())
    assert engine.caches[Role.LARGE].pool.by_hash
    engine.prefix_caching = False
    assert not engine.caches[Role.LARGE].pool.by_hash and not engine.caches[Role.LARGE].pool.idle
    assert all(c.cost.large_cached_tokens == 0 for c in run(engine, LargeOnly()))
    with pytest.raises(ValueError, match="prefix_caching"):
        engine.prefix_caching = "yes"  # type: ignore[assignment]


def test_the_server_reports_cached_prompt_tokens(llama_paths) -> None:
    import openai

    from ead_llm import EntropyAdaptiveLLM
    from ead_llm.serving.server import create_app
    from tests.serving.conftest import serve

    small, large = llama_paths
    llm = EntropyAdaptiveLLM(small=str(small), large=str(large), policy=LargeOnly(), max_tokens=8)
    for url in serve(create_app(llm, "m")):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        first, second = (client.completions.create(model="m", prompt=SHARED + "1+1=") for _ in range(2))
        assert first.choices[0].text == second.choices[0].text
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)]  # type: ignore[union-attr]
        assert cached[1] >= len(SHARED) // 2 and cached[1] > cached[0]


def test_langchain_and_dspy_report_cached_prompt_tokens(llama_paths) -> None:
    """The frameworks' own usage channels carry the large model's cached prompt tokens (OpenAI's meaning)."""
    import dspy

    from ead_llm import ChatEntropyAdaptive, EntropyAdaptiveLLM

    small, large = llama_paths
    chat = ChatEntropyAdaptive(small=str(small), large=str(large), policy=LargeOnly(), max_tokens=4)
    first, second = (chat.invoke(SHARED + "1+1=") for _ in range(2))
    assert "input_token_details" not in (first.usage_metadata or {})
    details = (second.usage_metadata or {}).get("input_token_details", {})
    assert details.get("cache_read", 0) >= len(SHARED) // 2
    assert details["cache_read"] == second.response_metadata["cost"]["large_cached_tokens"]

    lm = EntropyAdaptiveLLM(small=str(small), large=str(large), policy=LargeOnly(), max_tokens=4, cache=False)
    for _ in range(2):
        lm(SHARED + "2+2=")
    usage = lm.history[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == lm.history[-1]["ead_cost"]["large_cached_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(lm, dspy.BaseLM)


@pytest.mark.parametrize(
    "policy", [LargeOnly(), EAD(threshold=0.3), SpeculativeDecoding(gamma=3)], ids=lambda p: p.name
)
@pytest.mark.parametrize("native", [True, False], ids=["own-attention-kernel", "torch-attention"])
def test_a_hit_reads_the_same_bits_as_the_prompt_computed_whole(
    llama_pair: ModelPair, policy: Policy, native: bool
) -> None:
    """Sampled requests whose prompts start alike, cold then warm (hits leaving 1, 2 or 4 positions, of blocks the
    cold call's prompts cached; and a new prompt's hit on another's blocks, leaving 11): every token, entropy and
    hidden state is the bits it gets with caching off. (Before prompts were attended in chunks, a hit's last
    positions were attended over the cached keys, summed in another order than the cold call's one causal pass: 6 of
    64 sampled rows of a big-vocabulary pair changed tokens; and a hit leaving one position attended it as a decode
    step.)"""
    gen = torch.Generator().manual_seed(11)

    def tokens(n: int) -> list[int]:
        return torch.randint(4, llama_pair.vocab_size, (n,), generator=gen).tolist()

    shared = tokens(40)
    prompts = [shared[:33], [*shared[:17], *tokens(1)], [*shared, *tokens(9)], [*shared[:32], *tokens(20)]]
    prompts.append([*shared[:40], *tokens(3)])  # in the warm call only
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    engines = [Engine(llama_pair, return_hidden_states=True) for _ in range(2)]
    engines[0].prefix_caching = False
    for engine in engines:
        for runner in engine.runners.values():
            runner.native_attention = native and runner.native_attention
    try:
        plain = engines[0].generate([Request(p, policy, params) for p in prompts])
        cold = engines[1].generate([Request(p, policy, params) for p in prompts[:4]])
        warm = engines[1].generate([Request(p, policy, params) for p in reversed(prompts)])[::-1]
    finally:
        for engine in engines:
            engine.close()
    assert [c.cost.large_cached_tokens for c in warm] == [32, 16, 48, 48, 32]
    for expected in (plain, cold):
        for a, b in zip(expected, warm, strict=False):
            assert a.token_ids == b.token_ids and a.roles == b.roles and a.entropies == b.entropies
            assert a.hidden_states is not None and b.hidden_states is not None
            torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=0, atol=0, equal_nan=True)


def test_a_prompt_that_extends_an_answer_reads_the_answer_as_a_prompt(llama_pair: ModelPair) -> None:
    """A conversation's next prompt holds the last answer: the answer's positions were computed as decode steps, in
    other sums than a prompt's chunks, so only prompt blocks are cached and the next prompt computes the answer's
    positions as a prompt: its bits are those it gets with caching off (its hit ends where the first prompt did)."""
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(4, llama_pair.vocab_size, (37,), generator=gen).tolist()
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=2, ignore_eos=True)
    engines = [Engine(llama_pair, return_hidden_states=True) for _ in range(2)]
    engines[0].prefix_caching = False
    try:
        answer = engines[1].generate([Request(first, LargeOnly(), params)])[0].token_ids
        following = [*first, *answer, *torch.randint(4, llama_pair.vocab_size, (5,), generator=gen).tolist()]
        got, expected = (e.generate([Request(following, LargeOnly(), params)])[0] for e in reversed(engines))
    finally:
        for engine in engines:
            engine.close()
    assert got.cost.large_cached_tokens == 32  # the first prompt's whole blocks, none of the answer's
    assert got.token_ids == expected.token_ids and got.entropies == expected.entropies
    assert got.hidden_states is not None and expected.hidden_states is not None
    torch.testing.assert_close(got.hidden_states, expected.hidden_states, rtol=0, atol=0, equal_nan=True)
