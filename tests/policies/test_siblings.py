"""Siblings: greedy speculative rounds that also verify the draft model's second choice at each drafted position,
in the same pass (a tree of the chain and one leaf per position). Lossless, and a round whose correction is that
second choice closes with two of the large model's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ead_llm import EASD, LargeOnly, SpeculativeDecoding
from ead_llm.core import model_runner
from ead_llm.core.engine import Engine
from ead_llm.core.kv_cache import KVCache, SequenceKV
from ead_llm.core.loading import ModelPair
from ead_llm.core.model_runner import ModelRunner, PassRow, RunnerOutput, tree_mask
from ead_llm.core.rejection_sampler import verify
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role, RoundVerdict, TokenSample
from tests.core.test_rejection_sampler import SURE, batch, logits_of, row

PROMPTS = ["12+35=", "The quick brown fox", "a+b=", "9876-5432+1111", "hello world", "7*8="]


def test_the_tree_mask_shows_each_sibling_the_positions_before_its_draft_and_itself() -> None:
    """A row fed at positions 5..7 (its drafts at 6 and 7) with two siblings, whose keys lie at slots 8 and 9."""
    mask = tree_mask(start=5, end=8, drafts=2, siblings=2, device=torch.device("cpu"))[0, 0]
    assert mask.shape == (5, 10)
    for i, position in enumerate((5, 6, 7)):  # the chain: causal, never a sibling's slot
        assert mask[i].tolist() == [k <= position for k in range(10)]
    assert mask[3].tolist() == [k < 6 or k == 8 for k in range(10)]  # beside the draft at 6
    assert mask[4].tolist() == [k < 7 or k == 9 for k in range(10)]  # beside the draft at 7


def _runner(pair: ModelPair, block_size: int) -> ModelRunner:
    loaded = pair.model(Role.LARGE)
    cache = KVCache(loaded.model.config.num_hidden_layers, block_size=block_size)
    return ModelRunner(loaded, pair.device, pair.vocab_size, cache)


def _scatter(runner: ModelRunner, kv: SequenceKV, length: int, every: int) -> None:
    """Reserve ``length`` positions for ``kv``, another sequence taking a block after every ``every`` of its own (its
    blocks then lie in stretches of ``every``; 0: in one run)."""
    other = SequenceKV()
    size = runner.cache.block_size
    for blocks in range(1, runner.cache.blocks_for(length) + 1):
        runner.cache.reserve(kv, min(length, blocks * size))
        if every and blocks % every == 0:
            runner.cache.reserve(other, (len(other.blocks) + 1) * size)


def _verify_pass(
    runner: ModelRunner, vocab: int, seed: int, sizes: tuple[int, int, int], every: int
) -> tuple[list[int], list[int], tuple[int, ...], SequenceKV, RunnerOutput]:
    """Random prompt, drafts and siblings of ``sizes``; a row holding them, its blocks in stretches of ``every``
    (:func:`_scatter`), fed all but the prompt's last token, then verified with siblings in one pass."""
    gen = torch.Generator().manual_seed(seed)
    prompt, drafts, siblings = (torch.randint(4, vocab, (n,), generator=gen).tolist() for n in sizes)
    tokens = prompt + drafts
    kv = SequenceKV()
    _scatter(runner, kv, len(tokens) + len(siblings), every)
    runner.execute([PassRow(kv, prompt[:-1])])
    out = runner.execute([PassRow(kv, tokens, read=len(drafts) + 1, siblings=tuple(siblings))])
    return prompt, drafts, tuple(siblings), kv, out


@torch.inference_mode()
@pytest.mark.parametrize("every", [0, 2, 1], ids=["in_order", "in_stretches", "scattered"])
def test_the_runner_reads_each_sibling_as_the_model_reads_that_text(pair: ModelPair, every: int) -> None:
    """A verify pass with siblings gives, after each sibling, the model's own logits for the text that ends with it
    (the prompt, the drafts before its position, the sibling), and the chain's logits as without siblings, whether
    the row's blocks lie in one run or in stretches; the siblings' keys go to scratch slots and the row's length
    counts its own tokens only, while the work billed counts the siblings too (on the fused Llama forward and on
    transformers' modules)."""
    runner = _runner(pair, block_size=4)
    prompt, drafts, siblings, kv, out = _verify_pass(runner, pair.vocab_size, 1, (9, 3, 3), every)
    tokens = prompt + drafts
    assert (len({b - i for i, b in enumerate(kv.blocks)}) > 1) == bool(every)

    def model(text: list[int]) -> torch.Tensor:
        return runner.model(input_ids=torch.tensor([text])).logits[0, -1, : pair.vocab_size].float()

    assert not out.failures and out.siblings == {0: 3}
    assert out.logits.shape[0] == len(drafts) + 1 + len(siblings)
    assert kv.length == len(tokens) and out.work[0].tokens == 1 + len(drafts) + len(siblings)
    for j in range(len(drafts) + 1):  # the chain
        torch.testing.assert_close(out.logits[j], model(tokens[: len(prompt) + j]), atol=1e-4, rtol=1e-4)
    for d, sibling in enumerate(siblings):
        got = out.logits[len(drafts) + 1 + d]
        torch.testing.assert_close(got, model([*prompt, *drafts[:d], sibling]), atol=1e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("every", [0, 1], ids=["in_order", "scattered"])
@pytest.mark.parametrize("view_min", [512, 8], ids=["short-row", "long-row-in-pieces"])
def test_each_draft_and_sibling_gets_the_bits_a_decode_step_of_that_text_gets(
    llama_pair: ModelPair, every: int, view_min: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With exact verification, the logits after each draft and each sibling of a verify pass are, to the last bit,
    those of one-token decode steps that fed the same text after the same prompt (so a near-tie cannot turn a
    verification's argmax away from what decoding would pick), over views, copies and pieces of 8 positions alike."""
    monkeypatch.setattr(model_runner, "VIEW_MIN", view_min)
    monkeypatch.setattr(model_runner, "SPLIT", 8)
    runner = _runner(llama_pair, block_size=4)
    runner.exact_verification = True
    prompt, drafts, siblings, _, out = _verify_pass(runner, llama_pair.vocab_size, 2, (11, 4, 3), every)
    tokens = prompt + drafts
    assert out.siblings == {0: 3}

    def decoded(text: list[int]) -> torch.Tensor:
        other = SequenceKV()
        _scatter(runner, other, len(text), 1 - every)
        runner.execute([PassRow(other, prompt[:-1])])  # the same prompt pass, then one token a step
        for end in range(len(prompt), len(text) + 1):
            logits = runner.execute([PassRow(other, text[:end])]).logits[0]
        runner.cache.free(other)
        return logits

    for j in range(len(drafts) + 1):
        assert torch.equal(out.logits[j], decoded(tokens[: len(prompt) + j])), j
    for d, sibling in enumerate(siblings):
        assert torch.equal(out.logits[len(drafts) + 1 + d], decoded([*prompt, *drafts[:d], sibling])), d


@torch.inference_mode()
def test_a_row_short_of_room_reads_no_siblings(pair: ModelPair) -> None:
    """The siblings' keys need the slots after the row's end (reserved by the scheduler); where they were not
    reserved, the pass reads its chain alone and says so (the round is then judged as without siblings)."""
    runner = _runner(pair, block_size=1)
    tokens = list(range(4, 16))
    short = SequenceKV()
    runner.cache.reserve(short, len(tokens))  # no room after the end
    runner.execute([PassRow(short, tokens[:8])])
    out = runner.execute([PassRow(short, tokens, read=3, siblings=(5, 6))])
    assert not out.failures and out.siblings == {0: 0} and out.logits.shape[0] == 3 and out.work[0].tokens == 4


def test_a_greedy_rejection_whose_correction_is_the_sibling_closes_with_the_token_after_it() -> None:
    """Rejected at the second draft, where the large model's own token is the sibling read there: the round closes
    with it and with the large model's argmax after it (read at the sibling). Not when the sibling differs, when the
    round had no sibling there, when every draft stood, nor for sampled rounds."""
    small = logits_of(*SURE)  # drafts 0, 1, 2
    differ = logits_of(SURE[0], SURE[2], SURE[2], SURE[1])  # the large model writes 2 where draft 1 stood
    agree = logits_of(SURE[0], SURE[1], SURE[2], SURE[1])
    after = logits_of(SURE[1], SURE[0], SURE[1])  # after each sibling: 1, 0, 1

    def judged(siblings: list[list[int]], counts: list[int], targets: list[torch.Tensor], temperature: float = 0.0):
        b = batch([[0, 1, 2]] * len(targets), [small] * len(targets), targets, temperature=temperature)
        b = type(b)(
            **{
                **b.__dict__,
                "sibling_tokens": torch.tensor(siblings),
                "sibling_count": torch.tensor(counts),
                "sibling_logits": torch.stack([after] * len(targets)),
            }
        )
        return verify(b)

    out = judged([[3, 2, 4], [3, 5, 4], [3, 2, 4], [3, 2, 4]], [3, 3, 1, 3], [differ, differ, differ, agree])
    assert row(out, 0) == (1, 2, 0) and int(out.extra[0]) == 0  # sibling 2 matched: the argmax after it
    assert float(out.extra_entropy[0]) > 0
    assert row(out, 1) == (1, 2, 0) and int(out.extra[1]) == -1  # the sibling was 5
    assert row(out, 2) == (1, 2, 0) and int(out.extra[2]) == -1  # only the first position had a sibling
    assert row(out, 3) == (3, 1, 0) and int(out.extra[3]) == -1  # every draft stood: a bonus, no sibling read
    sampled = judged([[3, 2, 4]], [3], [differ], temperature=1.0)
    assert int(sampled.extra[0]) == -1


def _run(engine: Engine, policy: object, *, together: bool, **sampling: float) -> list:
    params = SamplingParams(max_tokens=40, **sampling)  # type: ignore[arg-type]
    requests = [Request(p, policy, params) for p in PROMPTS]  # type: ignore[arg-type]
    return engine.generate(requests) if together else [engine.generate([r])[0] for r in requests]


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
def test_siblings_keep_greedy_text_and_save_verifications(engine: Engine, together: bool) -> None:
    """On a random pair (its draft is often wrong), greedy speculative decoding with siblings writes LargeOnly's
    tokens, alone and batched; some rounds close with a sibling's extra token, and so the large model runs fewer
    verifications than without siblings (the drafts the small model makes are the same up to each round's end)."""
    reference = [c.token_ids for c in _run(engine, LargeOnly(), together=together)]
    plain = _run(engine, SpeculativeDecoding(gamma=3), together=together)
    tree = _run(engine, SpeculativeDecoding(gamma=3, siblings=True), together=together)
    assert [c.token_ids for c in tree] == reference == [c.token_ids for c in plain]
    extra = sum(c.cost.extra["sibling_tokens"] for c in tree)
    assert extra > 0
    # every round closes with one large-model token (greedy), and a sibling's round with one more
    rounds = [sum(c.cost.large_tokens for c in plain), sum(c.cost.large_tokens for c in tree) - extra]
    assert rounds[1] < rounds[0]


def test_sampled_and_easd_rounds_keep_their_own_rules(engine: Engine) -> None:
    """Siblings are read for greedy rows only: a sampled request's text with siblings on is its text without (the
    same seed), and EASD with siblings stays within its own rule (its texts as without siblings, greedy)."""
    kw = {"temperature": 1.0, "seed": 3}
    with_siblings = _run(engine, SpeculativeDecoding(gamma=3, siblings=True), together=False, **kw)
    without = _run(engine, SpeculativeDecoding(gamma=3), together=False, **kw)
    assert [c.token_ids for c in with_siblings] == [c.token_ids for c in without]
    assert sum(c.cost.extra["sibling_tokens"] for c in with_siblings) == 0
    easd = [EASD(gamma=3, entropy_threshold=0.5), EASD(gamma=3, entropy_threshold=0.5, siblings=True)]
    assert [c.token_ids for c in _run(engine, easd[0], together=False)] == [
        c.token_ids for c in _run(engine, easd[1], together=False)
    ]


def test_the_decoder_asks_for_siblings_only_on_greedy_unconstrained_rows() -> None:
    """The second choices ride on the drafts' top two; a sampled or constrained row reads none."""
    policy = SpeculativeDecoding(gamma=2, siblings=True)
    decoder = policy.build_decoder(0, {})
    assert decoder.branch_stats
    logits = torch.zeros(8)
    view = SimpleNamespace(
        tokens=[1, 2, 3], generated=0, max_length=20, params=SamplingParams(), grammar=None, is_end=lambda t: False
    )
    assert decoder.read(view).role is Role.SMALL
    for token, second in ((5, 6), (7, 4)):
        decoder.on_token(view, TokenSample(Role.SMALL, token, 0.1, logits, top2=(token, second)), room=None)
        view.tokens.append(token)
    read = decoder.read(view)
    assert read.verify and read.drafts == 2 and read.siblings == (6, 4)
    view.params = SamplingParams(temperature=0.7)
    assert decoder.read(view).siblings == ()
    view.params, view.grammar = SamplingParams(), object()
    assert decoder.read(view).siblings == ()
    assert not SpeculativeDecoding(gamma=2).build_decoder(0, {}).branch_stats


def test_a_sibling_round_keeps_the_siblings_keys_where_its_token_now_stands() -> None:
    """The round closes with the correction (the sibling read after the row's end) and the token after it; the
    sibling's keys move to the correction's position, so the large model has seen it and the draft reads the large
    model's features there (not fed again next round)."""
    decoder = SpeculativeDecoding(gamma=3, siblings=True).build_decoder(0, {})
    view = SimpleNamespace(
        tokens=[1, 2, 3, 4], generated=0, max_length=40, params=SamplingParams(), grammar=None, is_end=lambda t: False
    )
    decoder.read(view)
    for token in (5, 6, 7):
        decoder.on_token(view, TokenSample(Role.SMALL, token, 0.1, torch.zeros(9), top2=(token, 8)), room=None)
        view.tokens.append(token)
    verdict = RoundVerdict(accepted=1, token=8, entropy_rejection=False, target_entropy=(0.1,) * 4, extra=2)
    rollback, *emitted = decoder.on_verdict(view, verdict)
    assert rollback.keep == 4 and rollback.moves == ((Role.LARGE, 7 + 1, 4 + 1),)
    assert dict(rollback.seen) == {Role.LARGE: 6, Role.SMALL: 5}
    assert [(e.token, e.role) for e in emitted] == [(5, Role.SMALL), (8, Role.LARGE), (2, Role.LARGE)]
    assert dict(emitted[0].counters)["sibling_tokens"] == 1


def test_moving_a_position_copies_its_keys_values_and_features_in_every_layer() -> None:
    cache = KVCache(2, block_size=2)
    kv = SequenceKV()
    cache.reserve(kv, 6)
    slots = torch.tensor([kv.blocks[p // 2] * 2 + p % 2 for p in range(6)])
    for layer in range(2):
        keys = torch.arange(6 * 3 * 4, dtype=torch.float32).view(6, 3, 4) + 100 * layer
        cache.write(layer, slots, keys, -keys)
    cache.write_features(slots, torch.arange(6 * 5, dtype=torch.float32).view(6, 5))
    cache.move(kv, 5, 1)
    for layer in range(2):
        keys, values = cache.keys[layer], cache.values[layer]
        assert keys is not None and values is not None
        assert torch.equal(keys[:, slots[1]], keys[:, slots[5]]) and torch.equal(
            values[:, slots[1]], -keys[:, slots[5]]
        )
        assert not torch.equal(keys[:, slots[0]], keys[:, slots[5]])
    assert torch.equal(cache.read_features(slots[1:2]), cache.read_features(slots[5:6]))
