"""A draft that reads its target's hidden states (EAGLE-style): the runner hands over the right features
(the target's where it ran, the draft's own where it ran ahead, zeros where neither did), and every policy
stays defined with it: speculative decoding is lossless, EAD, EASD and EAGER run and bill both models."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ead_llm import EAD, EAGER, EASD, LargeOnly, SmallOnly, SpeculativeDecoding
from ead_llm.core import fused_llama, kernels
from ead_llm.core.engine import Engine
from ead_llm.core.fused_draft import FusedDraft
from ead_llm.core.fused_llama import BFLOAT16, NATIVE_BF16, draft_bfloat16_kernel
from ead_llm.core.kv_cache import KVCache, SequenceKV
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.model_runner import ModelRunner, PassRow
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.drafts.model import FeatureDraft, assemble, new_draft, own_state, previous, register, target_features
from ead_llm.testing.tiny import TinyShape, build_tiny_pair, byte_bpe_tokenizer
from tests.core.test_fused_llama import bfloat16_rows_agree
from tests.tiny_pairs import BPE_CORPUS, CHAT_TEMPLATE


@pytest.fixture(
    scope="module", params=[(1, 1), (2, 1), (2, 2)], ids=["1-layer-draft", "2-layer-draft", "2-layer-wide-draft"]
)
def feature_pair(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """A tiny Llama target of one or two layers with a chat template, and a draft of as many layers made from it
    (in the wide one, MLPs of twice the target's units): its layers are the target's (so on its own it mostly
    agrees), its join slightly off the identity (so the features matter), its added MLP units' down columns not
    zero (so they count) and its head without every 7th token (so some drafts must be rejected)."""
    layers, mlp_width = request.param
    root = tmp_path_factory.mktemp("feature-pair")
    tokenizer = byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)
    tokenizer.chat_template = CHAT_TEMPLATE
    shape = TinyShape(hidden=64, layers=layers, heads=4, mlp=128)
    _, large = build_tiny_pair(root, tokenizer=tokenizer, large=shape)
    target = AutoModelForCausalLM.from_pretrained(large)
    draft = new_draft(target, torch.tensor([t for t in range(len(tokenizer)) if t % 7]), layers, mlp_width)
    assert len(draft.layers) == layers
    assert all(layer.mlp.down_proj.weight.shape == (64, 128 * mlp_width) for layer in draft.layers)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        draft.fc.weight.add_(torch.randn(draft.fc.weight.shape, generator=noise) * 0.02)
        for layer in draft.layers:
            layer.mlp.down_proj.weight[:, 128:].add_(torch.randn(64, 128 * (mlp_width - 1), generator=noise) * 0.02)
    draft.save_pretrained(root / "draft")
    tokenizer.save_pretrained(root / "draft")
    return root / "draft", large


def _models(pair: tuple[Path, Path]) -> tuple[FeatureDraft, torch.nn.Module]:
    register()
    return AutoModelForCausalLM.from_pretrained(pair[0]).eval(), AutoModelForCausalLM.from_pretrained(pair[1]).eval()


@torch.inference_mode()
def test_the_runner_hands_the_draft_the_targets_features_its_own_or_zeros(feature_pair: tuple[Path, Path]) -> None:
    draft, target = _models(feature_pair)
    engine = Engine(load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu")))
    small, large = engine.runners[Role.SMALL], engine.runners[Role.LARGE]
    tokens = torch.randint(5, 300, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    ids = torch.tensor([tokens])
    truth = target_features(target, ids)  # [1, T, H]

    def expect(features: torch.Tensor) -> torch.Tensor:
        return draft(ids, features=features).logits[0].float()

    # the draft reads the first 6 tokens before the target has run: zeros
    s_kv, l_kv = SequenceKV(), SequenceKV()
    engine.caches[Role.SMALL].reserve(s_kv, len(tokens))
    engine.caches[Role.LARGE].reserve(l_kv, len(tokens))
    got = small.execute([PassRow(s_kv, tokens[:6], read=6, target=l_kv)]).rows(0)
    zeros = torch.zeros_like(truth)
    assert torch.allclose(got, expect(zeros)[:6], atol=1e-5)
    assert torch.equal(got.isinf(), expect(zeros)[:6].isinf())  # -inf outside the head's tokens
    # one more token: it reads the draft's own output at position 5
    draft_out, _ = draft.draft_forward(ids[:, :6], zeros[:, :6])
    got = small.execute([PassRow(s_kv, tokens[:7], target=l_kv)]).rows(0)
    mixed = zeros.clone()
    mixed[0, 6] = draft_out[0, 5]
    assert torch.allclose(got[0], expect(mixed)[6], atol=1e-5)
    # the target runs over the first 9 tokens; the draft's next 2 read its features
    large.execute([PassRow(l_kv, tokens[:9])])
    got = small.execute([PassRow(s_kv, tokens[:9], read=2, target=l_kv)]).rows(0)
    mixed[0, 7:9] = previous(truth)[0, 7:9]
    assert torch.allclose(got, expect(mixed)[7:9], atol=1e-5)
    # the target's logits are unchanged by keeping its features
    assert torch.allclose(
        large.execute([PassRow(l_kv, tokens[:10])]).rows(0)[0], target(ids[:, :10]).logits[0, -1].float(), atol=1e-5
    )
    engine.close()


def _generate(engine: Engine, policy: object, **params: object) -> list[object]:
    prompts = ["The quick brown fox", "12 + 35 =", "def add(a, b):"]
    sampling = SamplingParams(max_tokens=24, **params)  # type: ignore[arg-type]
    return engine.generate([Request(p, policy, sampling) for p in prompts])  # type: ignore[arg-type]


@pytest.mark.parametrize("bfloat16", [False, True], ids=["float32-draft", "bfloat16-draft"])
def test_speculative_decoding_with_a_feature_draft_is_lossless(feature_pair: tuple[Path, Path], bfloat16: bool) -> None:
    """Greedy speculative decoding (fixed and adaptive gamma) writes LargeOnly's text, and seeded sampling
    gives the same text twice; drafts are accepted (the draft is its target's last layer) and some rejected. The
    same with the draft's products in bfloat16."""
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    engine = Engine(pair, draft_bfloat16=bfloat16)
    reference = [o.token_ids for o in _generate(engine, LargeOnly())]
    accepted = drafted = 0
    for policy in (
        SpeculativeDecoding(gamma=1),
        SpeculativeDecoding(gamma=3),
        SpeculativeDecoding(adaptive_gamma=True),
    ):
        outs = _generate(engine, policy)
        assert [o.token_ids for o in outs] == reference
        accepted += sum(o.cost.extra["accepted_tokens"] for o in outs)
        drafted += sum(o.cost.extra["drafted_tokens"] for o in outs)
    assert 0 < accepted < drafted
    sampled = [
        [o.token_ids for o in _generate(engine, SpeculativeDecoding(gamma=2), temperature=0.9, seed=7)] for _ in "ab"
    ]
    assert sampled[0] == sampled[1]
    engine.close()


@pytest.mark.parametrize("bfloat16", [False, True], ids=["float32-draft", "bfloat16-draft"])
def test_every_policy_stays_defined_with_a_feature_draft(feature_pair: tuple[Path, Path], bfloat16: bool) -> None:
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    engine = Engine(pair, draft_bfloat16=bfloat16)
    for policy in (
        SmallOnly(),
        EAD(threshold=0.5, window=2, min_dwell=2),
        EAD(threshold=1.0, lookahead=True),
        EASD(entropy_threshold=0.5),
        EAGER(max_paths=3, decoder=EAD(threshold=0.5, window=2, min_dwell=2)),
    ):
        outs = _generate(engine, policy)
        assert all(o.token_ids for o in outs), policy
        assert all(o.cost.completion_tokens == o.cost.small_tokens + o.cost.large_tokens for o in outs)
        again = _generate(engine, policy)
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # the prefix cache changes nothing
        if isinstance(policy, (EAD, EAGER)):  # both models wrote: the draft ran after the target and before it
            assert sum(o.cost.small_tokens for o in outs) > 0 and sum(o.cost.large_tokens for o in outs) > 0
        if isinstance(policy, EAGER):
            assert sum(o.cost.extra.get("branches", 0) for o in outs) > 0
    engine.close()


def test_a_draft_is_rebuilt_from_its_own_weights_and_its_targets(feature_pair: tuple[Path, Path]) -> None:
    draft, target = _models(feature_pair)
    own = own_state(draft)
    assert not any(k.startswith(("embed_tokens", "head")) for k in own)  # those are the target's
    again = assemble(target, draft.config, own)
    ids = torch.tensor([[5, 9, 40, 77]])
    assert torch.equal(again(ids).logits, draft(ids).logits)


def test_a_draft_has_at_most_its_targets_layers(feature_pair: tuple[Path, Path]) -> None:
    _, target = _models(feature_pair)
    for layers in (0, len(target.model.layers) + 1):
        with pytest.raises(ValueError, match="1 to"):
            new_draft(target, torch.arange(10), layers)
    for mlp_width in (0, len(target.model.layers) + 1):
        with pytest.raises(ValueError, match="times the target's width"):
            new_draft(target, torch.arange(10), 1, mlp_width)


@torch.inference_mode()
def test_a_wider_draft_starts_as_the_target_layers_it_copies(tmp_path: Path) -> None:
    """The added MLP units take other layers' gate and up rows but zero down columns: before training, a draft of
    twice and three times the width computes what the plain one does; its own weights rebuild it."""
    tokenizer = byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)
    _, large = build_tiny_pair(tmp_path, tokenizer=tokenizer, large=TinyShape(hidden=64, layers=3, heads=4, mlp=128))
    target = AutoModelForCausalLM.from_pretrained(large).eval()
    index = torch.arange(1, 300)
    ids = torch.tensor([[5, 9, 40, 77, 3, 120]])
    features = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1))
    plain = new_draft(target, index).eval()
    for times in (2, 3):
        wide = new_draft(target, index, 1, times).eval()
        mlp = wide.layers[0].mlp
        assert mlp.gate_proj.weight.shape[0] == 128 * times and not mlp.down_proj.weight[:, 128:].any()
        assert mlp.gate_proj.weight[128:].abs().sum() > 0  # the donors' rows, so the added units learn at once
        for a, b in zip(wide.draft_forward(ids, features), plain.draft_forward(ids, features), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        again = assemble(target, wide.config, own_state(wide))
        assert torch.equal(again(ids).logits, wide(ids).logits)


def test_a_draft_config_whose_mlp_is_no_multiple_of_its_targets_is_refused(feature_pair: tuple[Path, Path]) -> None:
    draft, target = _models(feature_pair)
    config = draft.config.__class__.from_dict({**draft.config.to_dict(), "intermediate_size": 200})
    with pytest.raises(ValueError, match="no multiple of its target"):
        assemble(target, config, own_state(draft))


def test_a_feature_draft_needs_a_llama_family_target(feature_pair: tuple[Path, Path], tmp_path: Path) -> None:
    tokenizer = byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)
    _, gpt2 = build_tiny_pair(tmp_path, family="gpt2", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="Llama-family target"):
        Engine(load_pair(LoadConfig(small=str(feature_pair[0]), large=str(gpt2), device="cpu")))


def test_a_draft_runner_without_its_target_is_refused(feature_pair: tuple[Path, Path]) -> None:
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    with pytest.raises(ValueError, match="needs the target"):
        ModelRunner(pair.small, pair.device, pair.vocab_size, KVCache(1))


def test_a_drafts_products_in_bfloat16_leave_greedy_text_and_seeds_as_they_were(
    feature_pair: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Asked for (this tiny draft is under the size where it is the default), the draft's products run in
    bfloat16: its logits move by bfloat16's rounding, greedy speculative decoding still writes LargeOnly's text, a
    seeded sampled request gets the same text alone and third in a batch, and turning it off gives float32's bits
    back. Where this CPU's oneDNN would give a row other bits in another batch, the engine says so and keeps
    float32."""
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    assert Engine(pair).draft_bfloat16 is False  # under 4 MB of products: float32 unless asked
    engine = Engine(pair, draft_bfloat16=True)
    assert engine.runners[Role.SMALL].draft_bfloat16_possible() is engine.draft_bfloat16  # asked: what it took
    kernels = {p.kernel for p in engine.runners[Role.SMALL]._draft.projections}  # type: ignore[union-attr]
    if not engine.draft_bfloat16:  # refused: only where oneDNN's bfloat16 rows differ between calls here
        assert draft_bfloat16_kernel() not in kernels and "stay as they are" in caplog.text
        assert not all(bfloat16_rows_agree(p.weight) for p in engine.runners[Role.SMALL]._draft.projections)  # type: ignore[union-attr]
        return
    assert kernels == {draft_bfloat16_kernel()}
    tokens = torch.randint(5, 300, (9,), generator=torch.Generator().manual_seed(3)).tolist()

    def draft_logits() -> torch.Tensor:
        s_kv, l_kv = SequenceKV(), SequenceKV()
        engine.caches[Role.SMALL].reserve(s_kv, len(tokens))
        engine.caches[Role.LARGE].reserve(l_kv, len(tokens))
        engine.runners[Role.LARGE].execute([PassRow(l_kv, tokens[:6])])
        out = engine.runners[Role.SMALL].execute([PassRow(s_kv, tokens, read=9, target=l_kv)]).rows(0)
        engine.caches[Role.SMALL].free(s_kv)
        engine.caches[Role.LARGE].free(l_kv)
        return out

    with torch.inference_mode():
        low = draft_logits()
        engine.draft_bfloat16 = False
        assert {p.kernel for p in engine.runners[Role.SMALL]._draft.projections} != {draft_bfloat16_kernel()}  # type: ignore[union-attr]
        full = draft_logits()
        reference = Engine(pair, draft_bfloat16=False)
        engine.draft_bfloat16 = True
    finite = full.isfinite()
    assert torch.equal(low.isfinite(), finite) and not torch.equal(low, full)
    assert (low - full)[finite].abs().max() <= 0.05 * full[finite].abs().max()
    assert [o.token_ids for o in _generate(engine, SpeculativeDecoding(gamma=3))] == [
        o.token_ids for o in _generate(reference, LargeOnly())
    ]
    sampled = SpeculativeDecoding(gamma=2)
    batch = _generate(engine, sampled, temperature=0.9, seed=7)
    alone = engine.generate(
        [Request("def add(a, b):", sampled, SamplingParams(max_tokens=24, temperature=0.9, seed=7))]
    )
    assert alone[0].token_ids == batch[2].token_ids
    engine.close()
    reference.close()


def test_draft_bfloat16_takes_a_bool_for_a_feature_draft_only(feature_pair: tuple[Path, Path], llama_pair) -> None:
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    with pytest.raises(ValueError, match="draft_bfloat16 must be True or False"):
        Engine(pair, draft_bfloat16="yes")  # type: ignore[arg-type]
    engine = Engine(pair)
    with pytest.raises(ValueError, match="draft_bfloat16 must be True or False"):
        engine.draft_bfloat16 = None  # type: ignore[assignment]
    engine.close()
    with pytest.raises(ValueError, match="applies to a draft that reads its target's hidden states"):
        Engine(llama_pair, draft_bfloat16=True)
    ordinary = Engine(llama_pair, draft_bfloat16=False)
    assert ordinary.draft_bfloat16 is False
    ordinary.close()


@contextlib.contextmanager
def _held_mid_request(engine: Engine) -> Iterator[None]:
    """A request running on ``engine`` with its step held at the start while the body runs; on leaving it goes on,
    and must write what it writes alone."""
    want = _generate(engine, SpeculativeDecoding(gamma=3))
    entered, release = threading.Event(), threading.Event()
    step = engine._step

    def held() -> None:
        entered.set()
        release.wait(30)
        step()

    engine._step = held  # type: ignore[method-assign]
    got: list[list[object]] = []
    caller = threading.Thread(target=lambda: got.append(_generate(engine, SpeculativeDecoding(gamma=3))))
    caller.start()
    try:
        assert entered.wait(30)
        yield
    finally:
        release.set()
        caller.join(30)
        engine._step = step  # type: ignore[method-assign]
    assert [o.token_ids for o in got[0]] == [o.token_ids for o in want]  # type: ignore[attr-defined]


def test_settings_a_pass_reads_are_refused_while_a_request_runs_and_change_when_idle(
    feature_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``draft_bfloat16`` and ``exact_verification`` are read by a pass under way, the limits by admission; set while
    a request runs (its step held at the start here), they are refused and change nothing, and the request writes
    what it writes undisturbed. (bfloat16 products said possible here, so that a change is asked for on any CPU.)"""
    monkeypatch.setattr(FusedDraft, "bfloat16_possible", lambda self: True)
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    engine = Engine(pair, draft_bfloat16=False)
    with _held_mid_request(engine):
        for setting, value in (("draft_bfloat16", True), ("exact_verification", not engine.exact_verification)):
            before = getattr(engine, setting)
            with pytest.raises(RuntimeError, match=f"{setting} can only change while no request runs"):
                setattr(engine, setting, value)
            assert getattr(engine, setting) == before
            setattr(engine, setting, before)  # the value it has: no change, so no refusal (a shared engine's objects)
        limits = (engine.max_batch, engine.kv_budget_tokens, engine.kv_block_size)
        with pytest.raises(RuntimeError, match="the engine's limits can only change while no request runs or waits"):
            engine.set_limits(max_batch=engine.max_batch + 1)
        assert (engine.max_batch, engine.kv_budget_tokens, engine.kv_block_size) == limits
        engine.set_limits(max_batch=engine.max_batch)  # the limits it has: no change, so no refusal
    flipped = not engine.exact_verification
    engine.exact_verification = flipped  # idle again: allowed
    engine.draft_bfloat16 = True
    engine.set_limits(max_batch=engine.max_batch + 1)
    assert engine.exact_verification is flipped and engine.max_batch == limits[0] + 1
    engine.close()


def test_a_cpu_with_no_bfloat16_kernel_keeps_the_draft_float32_and_says_so(
    feature_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Neither bfloat16 arithmetic nor our kernel here (no compiler, no AVX2): asked for bfloat16, the draft runs and
    reports float32, never a float32 kernel under the bfloat16 name."""
    from ead_llm.core import fused_draft

    monkeypatch.setattr(fused_draft, "draft_bfloat16_kernels", tuple)
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    engine = Engine(pair, draft_bfloat16=True)
    draft = engine.runners[Role.SMALL]._draft
    assert draft is not None and draft.bfloat16 is False and engine.draft_bfloat16 is False
    assert {p.kernel for p in draft.projections} == {draft.float32_kernel}
    assert draft.use_bfloat16(True) is False and "stay as they are" in caplog.text
    engine.close()


def test_a_draft_whose_bfloat16_rows_would_follow_their_batch_stays_float32_and_says_so(
    feature_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    probe = fused_llama.Projection._agreeing_from
    monkeypatch.setattr(
        fused_llama.Projection,
        "_agreeing_from",
        lambda self, counts: (
            34 if self.kernel in (BFLOAT16, NATIVE_BF16) else probe(self, counts)
        ),  # a call of 33 rows differs
    )
    engine = Engine(pair, draft_bfloat16=True)
    assert engine.draft_bfloat16 is False and "stay as they are" in caplog.text
    assert not {BFLOAT16, NATIVE_BF16} & {p.kernel for p in engine.runners[Role.SMALL]._draft.projections}  # type: ignore[union-attr]
    want = [o.token_ids for o in _generate(engine, LargeOnly())]
    assert [o.token_ids for o in _generate(engine, SpeculativeDecoding(gamma=3))] == want
    caplog.clear()
    with _held_mid_request(engine):  # another object asking for it while requests run: refused as when idle
        engine.draft_bfloat16 = True
        assert engine.draft_bfloat16 is False and "stay as they are" in caplog.text
    engine.close()


@pytest.mark.skipif(not kernels.available(), reason="falls back to ead-llm's own kernel, which does not build here")
def test_a_draft_whose_preferred_bfloat16_kernel_follows_the_batch_takes_ours(
    feature_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU's bfloat16 kernel (oneDNN's, preferred where the CPU has bfloat16 arithmetic) would give a row
    other bits in another call, the draft runs its bfloat16 products on ead-llm's own kernel instead of float32."""
    from ead_llm.core import fused_draft

    monkeypatch.setattr(fused_llama, "_AGREEMENT", {})
    monkeypatch.setattr(fused_draft, "draft_bfloat16_kernels", lambda: (BFLOAT16, NATIVE_BF16))  # as on a Zen 4
    probe = fused_llama.Projection._agreeing_from
    monkeypatch.setattr(
        fused_llama.Projection,
        "_agreeing_from",
        lambda self, counts: 2 if self.kernel == BFLOAT16 else probe(self, counts),  # a row alone differs
    )
    pair = load_pair(LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu"))
    engine = Engine(pair, draft_bfloat16=True)
    draft = engine.runners[Role.SMALL]._draft
    assert draft is not None and engine.draft_bfloat16 is True
    assert {p.kernel for p in draft.projections} == {NATIVE_BF16}
    assert draft.bfloat16_possible()
    want = [o.token_ids for o in _generate(engine, LargeOnly())]
    assert [o.token_ids for o in _generate(engine, SpeculativeDecoding(gamma=3))] == want
    engine.close()


@pytest.mark.parametrize("policy", [EASD(gamma=3), SpeculativeDecoding(gamma=3)], ids=lambda p: p.name)
def test_a_drafts_prompt_reads_no_features_so_a_cached_prompt_drafts_as_one_computed(
    feature_pair: tuple[Path, Path], policy: object
) -> None:
    """A prompt's positions read zeros in the draft, whatever the target holds there: with prefix caching the target
    may hold a prompt's first blocks already (another prompt's), and reading them made the draft's keys, and so its
    drafts, entropies and EASD's text, depend on what ran before (SmolLM2's shipped draft: one of 8 chat answers
    changed under EASD once earlier prompts had cached the chat template's blocks). Cold, warm (hits on another
    prompt's blocks and on its own) and with caching off, every token, role and entropy is the same."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(5, 300, (40,), generator=gen).tolist()
    prompts = [[*shared, *torch.randint(5, 300, (n,), generator=gen).tolist()] for n in (3, 9, 21)]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    config = LoadConfig(small=str(feature_pair[0]), large=str(feature_pair[1]), device="cpu")
    engines = [Engine(load_pair(config)) for _ in range(2)]
    engines[0].prefix_caching = False
    try:
        plain = engines[0].generate([Request(p, policy, params) for p in prompts])
        cold = [engines[1].generate([Request(p, policy, params)])[0] for p in prompts]  # each after the last
        warm = [engines[1].generate([Request(p, policy, params)])[0] for p in prompts]
    finally:
        for engine in engines:
            engine.close()
    assert [c.cost.large_cached_tokens for c in cold] == [0, 32, 32]
    assert [c.cost.small_cached_tokens for c in cold] == [0, 32, 32]
    for got in (cold, warm):
        for a, b in zip(plain, got, strict=True):
            assert a.token_ids == b.token_ids and a.roles == b.roles and a.entropies == b.entropies
