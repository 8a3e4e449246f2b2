"""The batched rejection sampler on its own: greedy and sampled rounds, EASD's mask, the oracle, padding."""

from __future__ import annotations

import math

import pytest
import torch

from ead_llm.core.ops import entropy_bits
from ead_llm.core.rejection_sampler import VerifyBatch, VerifyOutput, top_n_overlap, verify

V = 6


def logits_of(*rows: list[float]) -> torch.Tensor:
    """Logits from probabilities (0 -> -inf)."""
    return torch.tensor(rows).log()


def batch(
    drafts: list[list[int]],
    draft_logits: list[torch.Tensor],
    target_logits: list[torch.Tensor],
    *,
    temperature: float = 0.0,
    positions: list[int] | None = None,
    entropy_threshold: float = math.inf,
    top_n: int = 1,
    overlap_threshold: float = 1.0,
    oracle: bool = False,
    key: int = 5,
    top_p: float = 1.0,
) -> VerifyBatch:
    """Rounds padded to the longest, as the engine builds them."""
    rounds = len(drafts)
    gamma = max(len(d) for d in drafts)
    pad = torch.zeros(V)
    small = torch.stack(
        [torch.stack([*d, *[pad] * (gamma - len(d))]) if gamma else pad[None, :0].reshape(0, V) for d in draft_logits]
    )
    large = torch.stack([torch.stack([*t, *[t[-1]] * (gamma + 1 - len(t))]) for t in target_logits])
    return VerifyBatch(
        draft_tokens=torch.tensor([[*d, *[0] * (gamma - len(d))] for d in drafts], dtype=torch.long).reshape(
            rounds, gamma
        ),
        num_drafts=torch.tensor([len(d) for d in drafts]),
        draft_logits=small,
        draft_entropy=entropy_bits(small) if gamma else torch.zeros(rounds, 0),
        target_logits=large,
        temperature=torch.full((rounds,), temperature),
        top_k=torch.zeros(rounds, dtype=torch.long),
        top_p=torch.full((rounds,), top_p),
        keys=torch.full((rounds,), key, dtype=torch.long),
        positions=torch.tensor(positions or [10] * rounds),
        entropy_threshold=torch.full((rounds,), entropy_threshold),
        top_n=torch.full((rounds,), top_n, dtype=torch.long),
        overlap_threshold=torch.full((rounds,), overlap_threshold),
        oracle=torch.full((rounds,), oracle),
        max_top_n=top_n,
        any_sampled=temperature > 0,
        any_top_p=top_p < 1.0,
        any_entropy_rule=not math.isinf(entropy_threshold),
        any_oracle=oracle,
    )


def row(out: VerifyOutput, r: int) -> tuple[int, int, int]:
    return int(out.accepted[r]), int(out.token[r]), int(out.entropy_rejection[r])


SURE = [[0.9, 0.02, 0.02, 0.02, 0.02, 0.02], [0.02, 0.9, 0.02, 0.02, 0.02, 0.02], [0.02, 0.02, 0.9, 0.02, 0.02, 0.02]]


def test_greedy_rounds_stand_while_the_large_model_agrees() -> None:
    small = logits_of(*SURE)  # drafts 0, 1, 2
    agree = logits_of(SURE[0], SURE[1], SURE[2], SURE[1])
    differ = logits_of(SURE[0], SURE[2], SURE[2], SURE[1])
    out = verify(
        batch(
            [[0, 1, 2], [0, 1, 2], [0, 1], []], [small, small, small[:2], small[:0]], [agree, differ, agree, agree[:1]]
        )
    )
    assert row(out, 0) == (3, 1, 0)  # all stand, bonus = the large model's argmax after them
    assert row(out, 1) == (1, 2, 0)  # the second draft is rejected: the large model's own token
    assert row(out, 2) == (2, 2, 0)  # a shorter round in the same batch: its padding is ignored
    assert row(out, 3) == (0, 0, 0)  # no drafts: one token of the large model
    assert out.target_entropy.shape == (4, 4)


def test_sampled_rounds_emit_the_large_model_distribution() -> None:
    p_large = [0.5, 0.3, 0.15, 0.05, 0.0, 0.0]
    p_small = [0.2, 0.5, 0.05, 0.0, 0.25, 0.0]  # 4 is a token the large model never writes
    torch.manual_seed(0)
    n = 20000
    draws = torch.multinomial(torch.tensor(p_small), n, replacement=True)
    small, large = logits_of(p_small), logits_of(p_large, p_large)
    out = verify(
        batch(
            [[int(d)] for d in draws],
            [small] * n,
            [large] * n,
            temperature=1.0,
            positions=list(range(n)),
        )
    )
    first = torch.where(out.accepted > 0, draws, out.token)  # the first emitted token of each round
    counts = torch.bincount(first, minlength=V).double() / n
    assert counts[4] == 0  # never emitted, though drafted a quarter of the time
    assert 0.5 * float((counts - torch.tensor(p_large, dtype=torch.float64)).abs().sum()) < 0.02
    rate = float(out.accepted.double().mean())  # sum_x min(p, q)
    assert abs(rate - sum(min(a, b) for a, b in zip(p_large, p_small, strict=True))) < 0.02


def test_sampled_rounds_with_top_p_emit_the_large_model_nucleus() -> None:
    p_large = [0.5, 0.3, 0.15, 0.05, 0.0, 0.0]  # top-p 0.7: the nucleus is {0, 1}, renormalised 5/8, 3/8
    p_small = [0.2, 0.5, 0.05, 0.0, 0.25, 0.0]  # top-p 0.7 for the drafts: {1, 4}
    n = 20000
    small, large = logits_of(p_small), logits_of(p_large, p_large)
    drafts = torch.where(torch.rand(n, generator=torch.Generator().manual_seed(1)) < 0.5 / 0.75, 1, 4)
    out = verify(
        batch(
            [[int(d)] for d in drafts], [small] * n, [large] * n, temperature=1.0, positions=list(range(n)), top_p=0.7
        )
    )
    first = torch.where(out.accepted > 0, drafts, out.token)
    counts = torch.bincount(first, minlength=V).double() / n
    assert set(first.tolist()) <= {0, 1}
    assert abs(float(counts[0]) - 5 / 8) < 0.02 and abs(float(counts[1]) - 3 / 8) < 0.02


def test_easd_rejects_uncertain_agreement() -> None:
    flat_small = [0.3, 0.05, 0.25, 0.21, 0.19, 0.0]  # top-3 {0, 2, 3}
    flat_large = [0.3, 0.25, 0.05, 0.21, 0.19, 0.0]  # top-3 {0, 1, 3}, best other token 1
    small, large = logits_of(flat_small), logits_of(flat_large, flat_large)
    plain = verify(batch([[0]], [small], [large]))
    assert row(plain, 0) == (1, 0, 0)  # greedy: the draft is the large model's argmax, it stands
    easd = verify(batch([[0]], [small], [large], entropy_threshold=1.0, top_n=3, overlap_threshold=0.5))
    assert row(easd, 0) == (0, 1, 1)  # both unsure (> 1 bit), top-3 share 2/3 > 0.5: rejected, best other
    strict = verify(batch([[0]], [small], [large], entropy_threshold=3.0, top_n=3, overlap_threshold=0.5))
    assert row(strict, 0) == (1, 0, 0)  # not above 3 bits
    apart = verify(batch([[0]], [small], [large], entropy_threshold=1.0, top_n=3, overlap_threshold=0.7))
    assert row(apart, 0) == (1, 0, 0)  # 2/3 shared is not more than 0.7
    n = 400
    sampled = verify(
        batch(
            [[0]] * n,
            [small] * n,
            [large] * n,
            temperature=1.0,
            positions=list(range(n)),
            entropy_threshold=1.0,
            top_n=3,
            overlap_threshold=0.5,
        )
    )
    rejected = sampled.entropy_rejection.bool()
    assert bool(rejected.any()) and not bool((sampled.token[rejected] == 0).any())  # never the rejected draft


def test_the_oracle_follows_argmax_agreement_and_has_no_bonus() -> None:
    small = logits_of(SURE[0])
    agree, differ = logits_of(SURE[0], SURE[1]), logits_of(SURE[2], SURE[1])
    out = verify(batch([[3], [3], []], [small, small, small[:0]], [agree, differ, agree[:1]], oracle=True))
    assert row(out, 0) == (1, -1, 0)  # both argmaxes are 0: the draft stands (whatever was drafted), no bonus
    assert row(out, 1) == (0, 2, 0)  # they differ: the large model writes the position
    assert row(out, 2) == (0, 0, 0)  # nothing drafted: the large model's token


def test_an_oracle_round_among_others_is_judged_by_argmax_agreement_when_sampled() -> None:
    """Built as the engine builds a batch (:func:`verify_batch`), a sampled oracle round beside a plain one keeps a
    draft the large model could never draw where the two models' most likely tokens agree (the oracle's rule; the
    ratio rule would reject it), and the plain round rejects it."""
    from ead_llm.core.rejection_sampler import verify_batch
    from ead_llm.core.request import SamplingParams
    from ead_llm.core.types import DraftRound

    small = logits_of([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])[0]  # most likely 0; draws 1 often
    large = logits_of([0.9, 0.0, 0.1, 0.0, 0.0, 0.0], [0.9, 0.0, 0.1, 0.0, 0.0, 0.0])  # most likely 0; never 1
    params = [SamplingParams(temperature=1.0, max_tokens=4)] * 2
    rounds = [DraftRound((1,), (small,), (1.0,), 10, oracle=oracle) for oracle in (True, False)]
    judged = verify(verify_batch(params, [5, 5], rounds, torch.stack([large, large]), gamma=1))
    assert judged.accepted.tolist() == [1, 0]


def test_the_overlap_is_worked_out_where_asked_and_is_the_whole_batchs_there() -> None:
    """EASD's top-N overlap, worked out at the positions where both models are unsure only (at most half of them), is
    what the whole batch's computation gives there (per round N and thresholds; ties in the logits), and False
    elsewhere; with more asked, the whole batch's."""
    from dataclasses import replace

    from ead_llm.core.rejection_sampler import _overlapping

    gen = torch.Generator().manual_seed(4)
    drafts = [[0, 1, 2]] * 5
    small = [[(torch.randn(V, generator=gen) * 2).round() for _ in d] for d in drafts]  # rounded: ties
    large = [[(torch.randn(V, generator=gen) * 2).round() for _ in range(len(d) + 1)] for d in drafts]
    rounds = replace(
        batch(drafts, small, large, entropy_threshold=0.5),
        top_n=torch.tensor([1, 2, 3, 4, 2]),
        overlap_threshold=torch.tensor([0.3, 0.5, 0.1, 0.6, 0.0]),
        max_top_n=4,
    )
    whole = top_n_overlap(rounds.draft_logits, rounds.target_logits[:, :3], rounds.top_n, 4)
    whole = whole > rounds.overlap_threshold[:, None]
    assert 0 < int(whole.sum()) < whole.numel()
    few = torch.rand(5, 3, generator=gen) < 0.4  # at most half asked: those alone
    assert 0 < int(few.sum()) <= 7 and torch.equal(_overlapping(rounds, few), whole & few)
    assert torch.equal(_overlapping(rounds, torch.ones(5, 3, dtype=torch.bool)), whole)  # all: the whole batch's
    assert not _overlapping(rounds, torch.zeros(5, 3, dtype=torch.bool)).any()


def test_top_n_overlap_per_round() -> None:
    a = torch.tensor([[[5.0, 4, 3, 2, 1]], [[5.0, 4, 3, 2, 1]]])
    b = torch.tensor([[[1.0, 4, 3, 5, 2]], [[1.0, 4, 3, 5, 2]]])
    # {0,1,2} vs {3,1,2}: 2/3; with n = 1: {0} vs {3}: 0
    assert top_n_overlap(a, b, torch.tensor([3, 1]), 3).flatten().tolist() == pytest.approx([2 / 3, 0.0])


@pytest.mark.parametrize("block_rounds", [1, 2])
def test_rounds_judged_in_blocks_get_the_verdicts_of_one_block(
    block_rounds: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds judged in cache-sized blocks (greedy and sampled, top-p, EASD's rule, the oracle, ragged drafts) get
    the verdicts, tokens and entropies the whole batch gets at once."""
    from ead_llm.core import sampler as sampler_module

    gen = torch.Generator().manual_seed(2)
    drafts = [[0, 1, 2], [1], [2, 2], [0, 1, 2], [3]]
    small = [[torch.randn(V, generator=gen) * 2 for _ in d] for d in drafts]
    large = [[torch.randn(V, generator=gen) * 2 for _ in range(len(d) + 1)] for d in drafts]
    cases = [
        {},
        {"temperature": 0.9},
        {"temperature": 0.9, "top_p": 0.8},
        {"temperature": 0.9, "entropy_threshold": 0.5, "top_n": 3, "overlap_threshold": 0.3},
        {"oracle": True},
    ]
    for case in cases:
        rounds = batch(drafts, small, large, positions=[3, 9, 4, 7, 1], **case)
        whole = verify(rounds)
        monkeypatch.setattr(sampler_module, "BLOCK_BYTES", 4 * V * 4 * block_rounds)  # G + 1 = 4 positions a round
        blocked = verify(rounds)
        monkeypatch.undo()
        for name in ("accepted", "token", "entropy_rejection", "target_entropy"):
            assert torch.equal(getattr(whole, name), getattr(blocked, name)), (case, name)
