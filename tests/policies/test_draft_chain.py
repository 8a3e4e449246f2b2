"""Draft chains: a greedy speculative round's drafts run back to back, without an engine step between. The same
tokens, entropies, bill and large-model passes as one draft per step, in fewer steps; an end of text or a failing
row ends a chain early, and sampled, constrained, sibling and entropy-stopped rounds draft one per step."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ead_llm import EASD, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.loading import ModelPair
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.core.types import Role, TokenSample
from ead_llm.testing.faults import InjectedFault, fail_passes
from ead_llm.testing.tiny import char_tokenizer
from tests.scripted import peaked, scripted_pair

PROMPTS = ["12+35=", "The quick brown fox", "a+b=", "9876-5432+1111", "hello world", "7*8="]
POLICIES = {
    "gamma3": SpeculativeDecoding(gamma=3),
    "adaptive": SpeculativeDecoding(gamma=2, adaptive_gamma=True),
    "easd": EASD(gamma=3, entropy_threshold=0.5),
}


def _view(completion: Completion) -> tuple[Any, ...]:
    """Everything a caller gets but the wall time."""
    c = completion
    return (c.text, c.token_ids, c.roles, c.entropies, c.finish_reason, replace(c.cost, wall_time_s=0.0))


def _run(pair: ModelPair, policy: Any, *, together: bool) -> tuple[list[Any], int]:
    """The views of ``PROMPTS``' completions on a new engine (nothing in its prefix cache), and its steps."""
    engine = Engine(pair)
    requests = [Request(p, policy, SamplingParams(max_tokens=40)) for p in PROMPTS]
    out = engine.generate(requests) if together else [engine.generate([r])[0] for r in requests]
    engine.close()
    return [_view(c) for c in out], engine.steps


def _unchained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds drafted one token per step, as before chains."""
    monkeypatch.setattr(SpeculativeDecoding, "drafts_ahead", lambda self, state: 0)


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_a_chain_gives_what_one_draft_per_step_gives_in_fewer_steps(
    pair: ModelPair, monkeypatch: pytest.MonkeyPatch, name: str, together: bool
) -> None:
    """Greedy speculative decoding (fixed and adaptive gamma) and EASD, each request alone and all together (rows
    at different points of their rounds): the same text, tokens, roles, entropies, finish and bill with chains as
    with one draft per step, in fewer engine steps. (Batched, rows reach their verifications in other company, and
    a row's attention among other rows' padded keys may round its logits' last bits differently: there the
    entropies agree to rounding.)"""
    chained, chained_steps = _run(pair, POLICIES[name], together=together)
    _unchained(monkeypatch)
    stepped, stepped_steps = _run(pair, POLICIES[name], together=together)
    if together:
        for mine, theirs in zip(chained, stepped, strict=True):
            assert mine[3] == pytest.approx(theirs[3], rel=1e-5, abs=1e-6)
        chained, stepped = [v[:3] + v[4:] for v in chained], [v[:3] + v[4:] for v in stepped]
    assert chained == stepped
    assert chained_steps < stepped_steps


def _eos_pair(eos_at: int) -> tuple[Any, Any, Any]:
    """A scripted pair whose two models agree: ``a`` until position ``eos_at``, then end of text."""
    tokenizer = char_tokenizer()  # the scripted pair's own
    vocab, eos, a = len(tokenizer), tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("a")

    def fn(position: int, sequence: list[int]) -> Any:
        return peaked(vocab, eos if position >= eos_at else a, 8.0)

    return scripted_pair(fn, fn)


def test_an_end_of_text_draft_ends_its_chain_with_no_pass_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts that stand, then an end-of-text draft in the middle of a round of 8: the chain stops there (the
    small model runs no pass after it, as one draft per step would not), and the text ends with the round."""
    runs = {}
    for mode in ("chained", "stepped"):
        if mode == "stepped":
            _unchained(monkeypatch)
        pair, small, large = _eos_pair(eos_at=7)
        engine = Engine(pair)
        out = engine.generate([Request("ab", SpeculativeDecoding(gamma=8), SamplingParams(max_tokens=30))])[0]
        runs[mode] = (_view(out), len(small.calls), len(large.calls))
        engine.close()
    assert runs["chained"] == runs["stepped"]
    view, small_passes, large_passes = runs["chained"]
    assert view[4] == "stop" and view[1][-1] in pair.eos_token_ids
    drafted = view[5].extra["drafted_tokens"]
    assert 1 < drafted < 8 and small_passes == drafted  # a pass per draft, none after the end
    assert large_passes == 1  # one verification: the prompt and the round, which closes the text


def test_a_row_failing_inside_its_chain_fails_alone(llama_pair: ModelPair) -> None:
    """A small-model pass that fails for one row on its third draft: that request fails, the others (batched with
    it, their chains running on) get the text they get alone. (On the fused Llama forward, whose rows keep their
    bits in any company; transformers' GPT-2 modules run ``F.linear``, which does not on every CPU.)"""
    policy = SpeculativeDecoding(gamma=4)
    expected, _ = _run(llama_pair, policy, together=False)
    engine = Engine(llama_pair)
    bad = engine.encode(PROMPTS[2])
    requests = [Request(p, policy, SamplingParams(max_tokens=40)) for p in PROMPTS]
    with fail_passes(engine, role="small", when=lambda ids: ids[: len(bad)] == bad and len(ids) >= len(bad) + 3) as log:
        out = engine.generate(requests, return_exceptions=True)
    assert log.raised > 0 and isinstance(out[2], InjectedFault)
    assert [c.token_ids for i, c in enumerate(out) if i != 2] == [v[1] for i, v in enumerate(expected) if i != 2]
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    engine.close()


def _seq(temperature: float = 0.0, grammar: Any = None) -> Any:
    return SimpleNamespace(
        tokens=[5, 6, 7],
        generated=0,
        max_length=100,
        params=SamplingParams(temperature=temperature, max_tokens=90),
        grammar=grammar,
        is_end=lambda token: False,
    )


def test_the_decoder_chains_the_rest_of_a_greedy_round_only() -> None:
    """A greedy unconstrained round chains all its drafts, then what is left of them; a sampled or constrained row,
    a round whose drafts' entropy may end it, and a round with siblings draw one per step."""
    decoder = SpeculativeDecoding(gamma=3).build_decoder(0, {})
    read = decoder.read(_seq())
    assert read.role is Role.SMALL and read.chain == 3
    for _ in range(2):  # two drafts taken
        decoder.on_token(_seq(), TokenSample(Role.SMALL, 9, 0.5, torch.zeros(4)), room=None)  # type: ignore[arg-type]
    assert decoder.read(_seq()).chain == 1
    for policy, seq in (
        (SpeculativeDecoding(gamma=3), _seq(temperature=0.7)),
        (SpeculativeDecoding(gamma=3), _seq(grammar=object())),
        (SpeculativeDecoding(gamma=3, siblings=True), _seq()),
    ):
        assert policy.build_decoder(0, {}).read(seq).chain == 0
    assert SpeculativeDecoding(gamma=3, stop_entropy=1.0).build_decoder(0, {}).read(_seq()).chain == 1


def test_chains_under_a_budget_too_small_for_everyone_keep_every_answer_and_bill(llama_pair: ModelPair) -> None:
    """Eight greedy speculative requests (gamma 4) in a KV budget of 12 blocks for 8 x 6: chains reserve their
    drafts' room up front and sequences are preempted, yet every text and bill is what the request gets alone,
    and no cache ever holds more than the budget."""
    prompts = [f"{i}+{i}=" for i in range(8)]
    requests = [
        Request(p, SpeculativeDecoding(gamma=4), SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts
    ]
    alone = Engine(llama_pair, kv_block_size=8)
    expected = [alone.generate([r])[0] for r in requests]
    alone.close()
    engine = Engine(llama_pair, max_batch=8, kv_budget_tokens=12 * 8, kv_block_size=8)
    loaded = engine.generate(requests)
    assert engine.scheduler.preemptions > 0
    assert all(cache.peak_blocks <= 12 for cache in engine.caches.values())
    billed = ("small_processed_tokens", "large_processed_tokens", "flops", "drafted_tokens", "accepted_tokens")
    assert all(want.cost.to_dict().get(k) is not None for k in billed for want in expected)
    for got, want in zip(loaded, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert {k: got.cost.to_dict().get(k) for k in billed} == {k: want.cost.to_dict().get(k) for k in billed}
    assert engine.load == {"running": 0, "waiting": 0, "reserved_kv": 0}
    engine.close()
