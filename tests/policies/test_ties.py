"""Lossless under ties: a tiny pair whose ``lm_head`` rows tie, so that top-k and top-p cuts fall inside
groups of exactly equal logits. Speculative decoding, EASD (where its rule cannot fire) and the oracle
(where the two models disagree on the top token) must emit the large model's filtered distribution:
the same support, and a total variation below 0.03 over 5,000 draws per setting.

The reference distribution is written out plainly in ``tests/reference.py`` (ties at a cut kept), from
the large model's own logits at the position drawn; every run is seeded, so the figures repeat exactly.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from ead_llm import EASD, LargeOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, ModelPair, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.policies.controls import OracleSwitching
from ead_llm.testing.tiny import build_tiny_pair
from tests.reference import reference_probs

PROMPT = "12+35="
DRAWS = 5000
LARGE_HEAD = [("7", 8.0), ("abc", 7.0), ("xy", 5.0)]
"""The large model's logits at the first generated position: ``7`` leads, ``a b c`` tie, ``x y`` tie."""
SMALL_HEAD = [("g", 8.0), ("a", 7.5), ("bc", 6.5), ("7", 6.0)]
"""The draft's: it prefers ``g`` (which the large model all but never writes) and ties ``b c``."""
SETTINGS = {
    "neither": {},
    "top_k": {"top_k": 2},  # the large model's 2nd..4th tokens tie: all of a, b, c stay
    "top_p": {"top_p": 0.6},  # the nucleus edge falls inside the a/b/c tie
    "both": {"top_k": 5, "top_p": 0.97},  # top-5 cuts inside the x/y tie; the nucleus edge falls inside it too
}


@torch.no_grad()
def _tie(model: Any, ids: list[int], head: list[tuple[str, float]], tokenizer: Any) -> torch.Tensor:
    """Rewrite ``model``'s ``lm_head`` so that after ``ids`` each listed token gets its logit exactly (tokens
    listed together share one row, hence one value) and every other token about 0; returns those logits."""
    hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]  # [H]
    weight = model.lm_head.weight  # [V, H]
    weight.mul_(0.01)
    for chars, logit in head:
        row = hidden * (logit / float(hidden @ hidden))
        for char in chars:
            weight[tokenizer.convert_tokens_to_ids(char)] = row
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.fixture(scope="module")
def tie_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelPair, torch.Tensor]:
    small, large = build_tiny_pair(tmp_path_factory.mktemp("ties"), family="llama", seed=0)
    pair = load_pair(LoadConfig(small=str(small), large=str(large), device="cpu"))
    ids = pair.tokenizer.encode(PROMPT)
    large_logits = _tie(pair.large.model, ids, LARGE_HEAD, pair.tokenizer)
    _tie(pair.small.model, ids, SMALL_HEAD, pair.tokenizer)
    token = pair.tokenizer.convert_tokens_to_ids
    assert large_logits[token("a")] == large_logits[token("b")] == large_logits[token("c")]  # exact ties
    assert large_logits[token("x")] == large_logits[token("y")]
    return pair, large_logits


@pytest.fixture(scope="module")
def engine(tie_pair: tuple[ModelPair, torch.Tensor]) -> Engine:
    return Engine(tie_pair[0], max_batch=256)


def first_tokens(engine: Engine, policy: Any, setting: dict[str, Any]) -> tuple[Counter[str], dict[str, int]]:
    """The first generated token of ``DRAWS`` seeded samples, and the policy's counters summed."""
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=11, **setting)
    out = engine.generate([Request(PROMPT, policy, params, sample_index=k) for k in range(DRAWS)])
    counters: Counter[str] = Counter()
    for completion in out:
        counters.update({k: v for k, v in completion.cost.extra.items() if isinstance(v, int)})
    tokens = Counter(engine.tokenizer.convert_ids_to_tokens(c.token_ids[0]) for c in out)
    return tokens, dict(counters)


def reference(engine: Engine, logits: torch.Tensor, setting: dict[str, Any]) -> dict[str, float]:
    probs = reference_probs(logits, 1.0, setting.get("top_k", 0), setting.get("top_p", 1.0))
    return {engine.tokenizer.convert_ids_to_tokens(i): float(p) for i, p in enumerate(probs.tolist()) if p > 0}


def total_variation(counts: Counter[str], probs: dict[str, float]) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / n - probs.get(t, 0.0)) for t in {*counts, *probs})


def check(engine: Engine, logits: torch.Tensor, policy: Any, setting: dict[str, Any]) -> dict[str, int]:
    tokens, counters = first_tokens(engine, policy, setting)
    probs = reference(engine, logits, setting)
    # the same support: nothing outside it, and every token likely enough to be seen in DRAWS draws is seen
    # (unfiltered, 70 tokens share 1% of the mass: those are checked by the total variation)
    assert set(tokens) <= set(probs), f"drawn outside the support: {sorted(set(tokens) - set(probs))}"
    assert {t for t, p in probs.items() if p * DRAWS >= 10} <= set(tokens)
    tv = total_variation(tokens, probs)
    assert tv < 0.03, f"total variation {tv:.4f}: {tokens} against {probs}"
    return counters


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_decoding_emits_the_large_distribution_under_ties(
    engine: Engine, tie_pair: tuple[ModelPair, torch.Tensor], setting: str
) -> None:
    counters = check(engine, tie_pair[1], SpeculativeDecoding(gamma=2), SETTINGS[setting])
    # drafts were made, and judged both ways (g, which the large model never keeps, is drafted often)
    assert counters["drafted_tokens"] >= DRAWS and 0 < counters["accepted_tokens"] < counters["drafted_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(
    "policy",
    [LargeOnly(), EASD(gamma=2, entropy_threshold=3.0), OracleSwitching()],
    ids=["large_only", "easd", "oracle"],
)
def test_every_policy_emits_the_large_distribution_under_ties(
    engine: Engine, tie_pair: tuple[ModelPair, torch.Tensor], policy: Any, setting: str
) -> None:
    """EASD's rule needs both entropies above 3 bits here, which neither model reaches (so it must be lossless);
    the oracle sees the models disagree on the top token (g against 7), so it must use the large model."""
    check(engine, tie_pair[1], policy, SETTINGS[setting])


def test_easd_rejections_stay_inside_the_large_support(
    engine: Engine, tie_pair: tuple[ModelPair, torch.Tensor]
) -> None:
    """Where EASD's rule fires it changes the distribution by design, but never beyond the large model's
    filtered support."""
    setting = SETTINGS["top_k"]
    policy = EASD(gamma=2, entropy_threshold=0.0, top_n=4, overlap_threshold=0.0)
    tokens, counters = first_tokens(engine, policy, setting)
    assert counters["entropy_rejections"] > 0
    assert set(tokens) <= set(reference(engine, tie_pair[1], setting))


def test_the_tie_pair_is_what_the_tests_assume(tie_pair: tuple[ModelPair, torch.Tensor]) -> None:
    """Each setting's cut falls inside a tie: without ties kept, its support would be smaller."""
    pair, logits = tie_pair
    token = pair.tokenizer.convert_tokens_to_ids
    top = torch.topk(logits, 6).indices.tolist()
    assert top[0] == token("7") and set(top[1:4]) == {token(c) for c in "abc"}
    assert set(top[4:]) == {token("x"), token("y")}
    assert int(reference_probs(logits, 1.0, 2, 1.0).gt(0).sum()) == 4  # top-2 keeps the whole a/b/c tie
    assert int(reference_probs(logits, 1.0, 0, 0.6).gt(0).sum()) == 4  # p = 0.6 ends inside it
    assert int(reference_probs(logits, 1.0, 5, 0.97).gt(0).sum()) == 6  # top-5 and p = 0.97 end inside x/y
