"""KV memory follows the tokens held: a budget bounds real memory, short requests do not pay for long ones."""

from __future__ import annotations

from ead_llm import EAD, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.accounting.ledger import Pricing
from ead_llm.core.engine import Engine
from ead_llm.core.kv_cache import KVCache
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.scheduler import Scheduler
from ead_llm.core.types import Role


def _bytes_per_position(engine: Engine, role: Role) -> int:
    """float32 keys and values of every layer for one position, from the model's shape."""
    config = engine.pair.model(role).model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4


def test_64_short_requests_and_a_long_one_fit_in_their_own_tokens(llama_pair) -> None:
    block = 16
    long_prompt = " ".join(str(i % 10) for i in range(150))  # 300 tokens with BOS
    long = Request(long_prompt, LargeOnly(), SamplingParams(max_tokens=100, ignore_eos=True))
    short = Request("12+35=", LargeOnly(), SamplingParams(max_tokens=9, ignore_eos=True))  # 7 + 9 = one block
    alone = Engine(llama_pair, kv_block_size=block)
    long_blocks = -(-(len(alone.encode(long_prompt)) + 100) // block)
    budget = (long_blocks + 64) * block  # what the long one needs, plus one block per short one
    expected = [c.token_ids for c in alone.generate([long])] + [alone.generate([short])[0].token_ids] * 64

    engine = Engine(llama_pair, max_batch=65, kv_budget_tokens=budget, kv_block_size=block)
    done = engine.generate([long, *[short] * 64])
    assert [c.token_ids for c in done] == expected
    assert engine.scheduler.peak_running == 65 and engine.scheduler.preemptions == 0  # all at once
    large = engine.caches[Role.LARGE]
    assert large.peak_blocks * block <= budget  # never more held than the budget
    # the memory itself: never more than the budget's positions allocated (the pool grows by doubling,
    # up to the budget); the previous engine gave each of the 65 slots the long one's length, 23x more
    assert 0 < large.peak_nbytes <= budget * _bytes_per_position(engine, Role.LARGE)
    assert engine.caches[Role.SMALL].peak_blocks == 0  # LargeOnly never touched the small model
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    assert large.pool.used == 0 and large.nbytes() > 0  # idle, its blocks kept for the prefix cache...
    engine.prefix_caching = False
    assert large.nbytes() == 0  # ...and released once nothing is cached


def test_a_budget_too_small_for_everyone_preempts_and_every_answer_is_still_right(llama_pair) -> None:
    prompts = [f"{i}+{i}=" for i in range(8)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    policies = [SmallOnly(), LargeOnly(), EAD(threshold=2.0, window=1, min_dwell=1)]
    requests = [Request(p, policies[i % 3], params) for i, p in enumerate(prompts)]
    alone = Engine(llama_pair, kv_block_size=8)
    expected = [alone.generate([r])[0].token_ids for r in requests]
    engine = Engine(llama_pair, max_batch=8, kv_budget_tokens=12 * 8, kv_block_size=8)  # 12 blocks for 8 x 6
    assert [c.token_ids for c in engine.generate(requests)] == expected
    assert engine.scheduler.preemptions > 0
    assert all(cache.peak_blocks <= 12 for cache in engine.caches.values())
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}


def test_a_bill_does_not_depend_on_the_load(llama_pair) -> None:
    """Preempted sequences are fed again when readmitted; those positions are recomputed_tokens, apart from
    the processed tokens, the FLOPs and the price, which are what the request costs alone."""
    prompts = [f"{i}+{i}=" for i in range(8)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, seed=5)
    policies = [SmallOnly(), LargeOnly(), EAD(threshold=2.0, window=1, min_dwell=1), SpeculativeDecoding(gamma=3)]
    requests = [Request(p, policies[i % 4], params) for i, p in enumerate(prompts)]
    pricing = Pricing(small_input=1.0, small_output=2.0, large_input=10.0, large_output=20.0)
    alone = Engine(llama_pair, kv_block_size=8)
    expected = [alone.generate([r], pricing=pricing)[0] for r in requests]
    engine = Engine(llama_pair, max_batch=8, kv_budget_tokens=12 * 8, kv_block_size=8)
    loaded = engine.generate(requests, pricing=pricing)
    assert engine.scheduler.preemptions > 0
    assert [c.token_ids for c in loaded] == [c.token_ids for c in expected]
    billed = ("small_processed_tokens", "large_processed_tokens", "flops", "cost_usd", "drafted_tokens")
    for got, want in zip(loaded, expected, strict=True):
        assert {k: got.cost.to_dict().get(k) for k in billed} == {k: want.cost.to_dict().get(k) for k in billed}
        assert want.cost.recomputed_tokens == 0
    assert sum(c.cost.recomputed_tokens for c in loaded) > 0


def test_forks_in_one_step_are_granted_only_the_blocks_left() -> None:
    """Each granted fork holds two blocks per model until the next reservation takes them."""
    caches = {role: KVCache(1, block_size=4, max_tokens=4 * 5) for role in Role}  # 5 free blocks each
    room = Scheduler(caches, max_batch=10, max_positions=None).fork_room()
    assert [room.take() for _ in range(4)] == [True, True, False, False]  # 2 + 2 of 5; a third needs 6
    assert room.granted == 2
