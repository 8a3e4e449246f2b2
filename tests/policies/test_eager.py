"""EAGER: branching at high-entropy tokens, the path cap and budget, the vote, the bill."""

from __future__ import annotations

import math

import pytest
import torch

from ead_llm import EAD, EAGER, EntropyAdaptiveLLM, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core.engine import Engine
from ead_llm.core.ops import top_k_entropy_nats
from ead_llm.core.request import Request, SamplingParams
from ead_llm.evaluation.task import problems
from ead_llm.policies.eager import RunningPercentile
from tests.scripted import scripted_pair

VOCAB = 78
N = 10  # tokens per path (EOS ignored)


def _pair(hard_for: dict[int, set[int]]):
    """The large model is sure of token 10, except at generated indices ``hard_for[prompt's 2nd id]``,
    where it spreads over tokens 10..17 (top-1 10, top-2 11; about ln 8 nats)."""

    def large_fn(position: int, history: list[int]) -> torch.Tensor:
        logits = torch.full((VOCAB,), -1e4)
        generated = position - 2  # prompts are two tokens
        if len(history) > 1 and generated in hard_for.get(history[1], set()):
            logits[10:18] = 0.0
            logits[10], logits[11] = 0.2, 0.1
        else:
            logits[10] = 0.0
        return logits

    return scripted_pair(large_fn, large_fn)


def _paths(engine: Engine, requests: list[Request]) -> dict[tuple[int, int], list[int]]:
    out: dict[tuple[int, int], list[int]] = {}
    for event in engine.stream(requests):
        out.setdefault((event.index, event.path), []).append(event.token_id)
    return out


def test_entropy_and_percentile_math() -> None:
    uniform = torch.zeros(50)
    assert float(top_k_entropy_nats(uniform, 20)) == pytest.approx(math.log(20))
    running = RunningPercentile()
    assert running.value(99) == -math.inf
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(200, generator=gen, dtype=torch.float64).tolist()
    for n, value in enumerate(values, start=1):  # kept sorted as values arrive: no re-sort per query
        running.add(value)
        for q in (0.0, 50.0, 90.0, 99.0, 100.0):
            assert running.value(q) == float(torch.quantile(torch.tensor(values[:n], dtype=torch.float64), q / 100))


def test_branches_fire_exactly_at_the_unsure_tokens() -> None:
    hard = {2, 6}
    pair, _, _ = _pair({5: hard})
    engine = Engine(pair)
    policy = EAGER(theta=1.0, max_paths=8, temperature=0.0)
    paths = _paths(engine, [Request([1, 5], policy, SamplingParams(max_tokens=N, ignore_eos=True))])
    assert paths[(0, 0)] == [10] * N  # the original keeps the top-1 token
    for (_, path), tokens in paths.items():
        if path:
            start = N - len(tokens)  # a path inherits its parent's tokens before the branch
            assert start in hard and tokens[0] == 11 and tokens[1:] == [10] * (len(tokens) - 1)
    # index 2: the one path branches. Index 6: path 0 branches; for path 1 the prompt's 99th percentile
    # now is the entropy both unsure tokens had, and the rule needs more than that: 3 paths
    assert len(paths) == 3
    median = EAGER(theta=1.0, max_paths=8, percentile=50.0, temperature=0.0)
    (done,) = engine.generate([Request([1, 5], median, SamplingParams(max_tokens=N, ignore_eos=True))])
    assert done.paths == 4 and done.cost.extra == {"paths": 4, "branches": 3}  # at the median both branch
    assert done.cost.completion_tokens == N + (N - 2) + 2 * (N - 6)
    assert done.cost.prompt_tokens == 2  # the branches copied the prefix's cache


def test_the_cap_and_the_shared_budget_hold() -> None:
    pair, _, _ = _pair({5: set(range(0, N, 2)), 6: set()})  # [1, 5] unsure at every other token, [1, 6] never
    engine = Engine(pair)
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    alone = EAGER(theta=1.0, max_paths=3, percentile=0.0, temperature=0.0)
    (hard,) = engine.generate([Request([1, 5], alone, params)])
    assert hard.paths == 3  # one prompt: the call's budget is its own cap
    done = engine.generate([Request([1, 5], alone, params), Request([1, 6], alone, params)])
    assert done[1].paths == 1 and done[0].paths == 5  # borrows the two the easy prompt left: 3 x 2 - 1
    tight = EAGER(theta=1.0, max_paths=3, percentile=0.0, temperature=0.0, budget_limit=1)
    done = engine.generate([Request([1, 5], tight, params), Request([1, 6], tight, params)])
    assert done[0].paths == 3  # budget_limit x max_paths


def test_infinite_theta_is_one_plain_path(pair) -> None:
    engine = Engine(pair)
    params = SamplingParams(max_tokens=20, ignore_eos=True, seed=5)
    (eager,) = engine.generate([Request("12+35=", EAGER(theta=math.inf, temperature=0.6), params)])
    (plain,) = engine.generate(
        [Request("12+35=", LargeOnly(), SamplingParams(max_tokens=20, ignore_eos=True, seed=5, temperature=0.6))]
    )
    assert eager.token_ids == plain.token_ids and eager.paths == 1 and eager.votes is not None


def test_vote_is_deterministic() -> None:
    policy = EAGER()
    assert policy.vote(["#### 3", "#### 4", "x #### 4", "#### 3"]) == (0, {"3": 2, "4": 2})  # tie: first answer
    hashes = EAGER(extractor="hashes")
    assert hashes.vote(["no answer", "#### 5", "#### 6", "#### 6"]) == (2, {"5": 1, "6": 2})
    assert hashes.vote(["nothing", "here"]) == (0, {})
    # the default votes on ordinary text too (the last line, normalised; numbers by value)
    plain = ["The capital is Kyoto.", "The capital is Tokyo.", "the capital  is tokyo", "Edo"]
    assert policy.vote(plain) == (1, {"the capital is kyoto": 1, "the capital is tokyo": 2, "edo": 1})
    assert policy.vote(["so x = 1,000", "x is 1000.0 then", "#### 7"]) == (0, {"1000": 2, "7": 1})
    assert policy.describe()["extractor"] == "auto" and hashes.describe()["extractor"] == "hashes"
    odd = EAGER(extractor=lambda text: text.strip()[-1:] or None)
    assert odd.vote(["ab", "cb", "zz"])[0] == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"theta": -1.0}, "theta"),
        ({"max_paths": 0}, "max_paths"),
        ({"percentile": 101.0}, "percentile"),
        ({"decoder": "large"}, "decoder"),
        ({"decoder": SpeculativeDecoding()}, "decoder"),
        ({"budget_limit": 0}, "budget_limit"),
        ({"extractor": 3}, "extractor"),
    ],
)
def test_bad_settings_name_the_parameter(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EAGER(**kwargs)


def test_through_the_llm_on_the_embedded_pair() -> None:
    llm = EntropyAdaptiveLLM(max_tokens=400)
    prompt = problems("test", 3)[2].prompt
    for decoder in (LargeOnly(), SmallOnly(), EAD(threshold=0.05)):
        result = llm.generate([prompt], policy=EAGER(theta=0.3, max_paths=4, decoder=decoder))
        info = result.generations[0][0].generation_info
        assert info is not None and 1 <= info["paths"] <= 4 and sum(info["votes"].values()) <= info["paths"]
        assert info["cost"]["paths"] == info["paths"] == info["branches"] + 1
    with pytest.raises(ValueError, match="vote"):
        list(llm.stream(prompt, policy=EAGER()))


def test_a_winning_branch_carries_the_prefix_it_shares_with_its_parent() -> None:
    pair, _, _ = _pair({5: {2}})  # one unsure token, at generated index 2
    engine = Engine(pair)
    tokenizer = pair.tokenizer
    seven = tokenizer.convert_tokens_to_ids("7")  # token 11; the sure token 10 is "6"
    assert seven == 11
    # only a text containing the branch's token votes, so the branch must win
    policy = EAGER(theta=1.0, max_paths=2, temperature=0.0, extractor=lambda text: "seven" if "7" in text else None)
    (done,) = engine.generate([Request([1, 5], policy, SamplingParams(max_tokens=N, ignore_eos=True))])
    assert done.paths == 2 and done.path == 1 and done.votes == {"seven": 1}
    assert done.token_ids == (10, 10, 11, *[10] * (N - 3))  # the parent's first two tokens, then the branch
    assert done.text == "667" + "6" * (N - 3) == tokenizer.decode(list(done.token_ids))
    assert len(done.roles) == len(done.entropies) == N


def test_a_lender_that_needs_its_share_later_finds_the_call_at_its_budget() -> None:
    # [1, 5] is unsure early and borrows; [1, 6] is unsure only later, after lending its share
    pair, _, _ = _pair({5: {0, 2, 4}, 6: {8}})
    engine = Engine(pair)
    policy = EAGER(theta=1.0, max_paths=2, percentile=0.0, temperature=0.0)  # budget: 2 x 2 paths
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    done = engine.generate([Request([1, 5], policy, params), Request([1, 6], policy, params)])
    assert [c.paths for c in done] == [3, 1]  # [1, 5] borrowed one; [1, 6]'s branch would be a fifth path
    assert sum(c.cost.extra["paths"] for c in done) == 4 == 2 * policy.max_paths


def test_counts_are_reported_when_nothing_branched() -> None:
    pair, _, _ = _pair({})
    engine = Engine(pair)
    (done,) = engine.generate([Request([1, 5], EAGER(theta=1.0), SamplingParams(max_tokens=4, ignore_eos=True))])
    assert done.paths == 1 and done.cost.extra == {"paths": 1, "branches": 0}
    lookahead = EAGER(theta=1.0, decoder=EAD(threshold=10.0, window=1, min_dwell=1, lookahead=True))
    (done,) = engine.generate([Request([1, 5], lookahead, SamplingParams(max_tokens=4, ignore_eos=True))])
    assert done.cost.to_dict()["branches"] == 0 and done.cost.to_dict()["withheld_tokens"] == 0


def test_plain_text_paths_vote_by_default(pair) -> None:
    engine = Engine(pair)
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=3)
    (done,) = engine.generate([Request("The quick brown", EAGER(theta=0.0, max_paths=3, temperature=0.9), params)])
    assert done.paths > 1 and sum(done.votes.values()) == done.paths  # every path's text gave an answer
