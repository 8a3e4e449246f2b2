"""The shipped SmolLM2 draft (``smollm2.fast_draft()``): its size and card, assembly once, lossless greedy
speculative decoding against LargeOnly on 8 chat prompts it never trained on, and the entropy policies on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ead_llm import EAD, EASD, LargeOnly, SpeculativeDecoding
from ead_llm.adapters.prompts import render
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Completion, Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.policies.base import Policy
from ead_llm.testing import smollm2

pytestmark = [pytest.mark.real_model, pytest.mark.slow]  # a minute or two: CI's slow set

CARD_KEYS = {"target", "design", "data", "steps", "seed", "command", "top1_agreement_after", "own_parameters"}


@pytest.fixture(scope="module")
def engine(real_paths: tuple[Path, Path]) -> Engine:
    full = real_paths[1]
    return Engine(load_pair(LoadConfig(small=str(smollm2.fast_draft()), large=str(full), device="cpu")))


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    """Four questions distill held out and four of the bench's, which it was told to leave out."""
    return [list(map(int, render(engine.tokenizer, [("user", q)], "chat"))) for q in smollm2.unseen_questions(8)]


@pytest.fixture(scope="module")
def large_only(engine: Engine, prompts: list[list[int]]) -> list[Completion]:
    """The reference: the target alone."""
    return run(engine, prompts, LargeOnly())


def run(engine: Engine, prompts: list[list[int]], policy: Policy) -> list[Completion]:
    return engine.generate([Request(p, policy, SamplingParams(max_tokens=32)) for p in prompts])


def test_the_shipped_draft_is_small_and_carries_its_card() -> None:
    size = sum(p.stat().st_size for p in smollm2.SHIPPED_DRAFT.iterdir())
    assert size <= 25 * 2**20
    card = json.loads((smollm2.SHIPPED_DRAFT / "draft_card.json").read_text())
    assert card.keys() >= CARD_KEYS
    assert card["target"] == smollm2.MODEL_NAME  # a model's name, not the path of one machine's cache
    assert card["command"].startswith("ead-llm distill")


def test_fast_draft_assembles_once(real_paths: tuple[Path, Path]) -> None:
    folder = smollm2.fast_draft()
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert smollm2.fast_draft() == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    ("policy", "least_accepted"),
    # gamma 1 drafts from the target's own features (the card's held-out agreement on the set's questions is 0.54,
    # 0.51 on questions the model wrote itself; untrained, 0.001); longer drafts read the draft's guesses of the
    # features from their second token on (0.50 and 0.48 for the second and third on the set's, trained on them)
    [(SpeculativeDecoding(gamma=1), 0.45), (SpeculativeDecoding(adaptive_gamma=True), 0.3)],
    ids=["gamma1", "adaptive"],
)
def test_greedy_speculative_decoding_with_the_draft_equals_large_only(
    engine, prompts, large_only, policy, least_accepted
) -> None:
    spec = run(engine, prompts, policy)
    assert [c.token_ids for c in spec] == [c.token_ids for c in large_only]
    drafted = sum(c.cost.extra["drafted_tokens"] for c in spec)
    accepted = sum(c.cost.extra["accepted_tokens"] for c in spec)
    assert drafted > 0 and accepted / drafted > least_accepted


@pytest.mark.parametrize(
    "policy",
    [
        EAD(threshold=1.0, window=3, min_dwell=2),
        EAD(threshold=1.0, window=3, min_dwell=2, lookahead=True, start_on=Role.LARGE),
        EASD(gamma=3),
    ],
    ids=["ead", "ead-lookahead", "easd"],
)
def test_entropy_policies_run_on_the_draft_and_bill_both_models(engine, prompts, policy) -> None:
    done = run(engine, prompts[:4], policy)
    assert all(c.token_ids for c in done)
    assert sum(c.cost.small_processed_tokens for c in done) > 0
    assert sum(c.cost.large_processed_tokens for c in done) > 0


def test_the_rows_a_pass_runs_as_change_no_bit_of_its_logits(engine: Engine, prompts: list[list[int]]) -> None:
    """SmolLM2's packed projections run a decode step as the row count they measured fastest (5 or 6 rows here):
    the step's logits are the same bits whatever row count its products run as."""
    import torch

    from ead_llm.core.kv_cache import SequenceKV
    from ead_llm.core.model_runner import PassRow

    runner = engine.runners[Role.LARGE]
    assert runner._fused is not None
    projections = runner._fused.projections
    tuned, prompt, kv = projections[0].widths, prompts[0], SequenceKV()
    try:
        with torch.inference_mode():
            runner.cache.reserve(kv, len(prompt))
            runner.execute([PassRow(kv, prompt[:-1])])

            def step() -> torch.Tensor:
                logits = runner.execute([PassRow(kv, prompt)]).logits[0]
                runner.cache.truncate(kv, len(prompt) - 1)
                return logits

            alone = step()
            for widths in ((), (0, 8), (0, 3)):  # as it is (two rows where one alone would differ), as 8, as 3
                for p in projections:
                    p.widths = widths
                assert torch.equal(step(), alone)
    finally:
        for p in projections:
            p.widths = tuned
        runner.cache.free(kv)
