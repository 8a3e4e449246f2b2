"""KV memory follows the tokens held: a budget bounds real memory, short requests do not pay for long ones."""

from __future__ import annotations

from ead_llm import EAD, LargeOnly, SmallOnly
from ead_llm.core.engine import Engine
from ead_llm.core.request import Request, SamplingParams
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
    assert large.nbytes() == 0  # released once idle


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
