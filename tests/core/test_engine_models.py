"""The full path on tiny random Llama and GPT-2 pairs saved to disk and loaded by path."""

from __future__ import annotations

import statistics

import pytest
import torch

from ead_llm.core.engine import Engine
from ead_llm.core.loading import ModelPair
from ead_llm.core.model_runner import PackedBatch
from ead_llm.core.output import first_stop
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import FinishReason, Role
from ead_llm.policies.base import LargeOnly, SmallOnly
from ead_llm.policies.switching import EAD
from tests.reference import reference_greedy

PROMPTS = ["12+35=", "The fox", "a", "9*9=81\n7*"]


def hf_greedy(pair: ModelPair, role: Role, prompt_ids: list[int], max_tokens: int) -> list[int]:
    model = pair.model(role).model
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=sorted(pair.eos_token_ids),
        pad_token_id=pair.tokenizer.pad_token_id or 0,
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize(("policy", "role"), [(SmallOnly(), Role.SMALL), (LargeOnly(), Role.LARGE)])
def test_single_model_greedy_equals_hf_generate(engine: Engine, policy, role: Role) -> None:
    requests = [Request(p, policy, SamplingParams(max_tokens=24)) for p in PROMPTS]
    for request, done in zip(requests, engine.generate(requests), strict=True):
        expected = hf_greedy(engine.pair, role, engine.encode(request.prompt), 24)
        assert list(done.token_ids) == expected
        assert set(done.roles) == {role}


def test_ead_greedy_equals_full_prefix_reference(engine: Engine) -> None:
    switched = 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        small_run = engine.generate([Request(prompt, SmallOnly(), SamplingParams(max_tokens=30))])[0]
        threshold = statistics.median(small_run.entropies)
        for policy in (
            EAD(threshold=threshold, window=2, min_dwell=2),
            EAD(threshold=threshold, window=5, min_dwell=0),
            EAD(threshold=threshold * 0.8, window=3, min_dwell=4, start_on="large"),
        ):
            done = engine.generate([Request(prompt, policy, SamplingParams(max_tokens=30))])[0]
            tokens, roles, entropies = reference_greedy(engine.pair, ids, policy, 30)
            assert list(done.token_ids) == tokens
            assert list(done.roles) == roles
            assert list(done.entropies) == pytest.approx(entropies, abs=1e-3)
            switched += done.cost.switches
    assert switched >= 10  # the comparison exercised many switches and catch-ups


def test_text_is_the_decoded_tokens(engine: Engine) -> None:
    for prompt in PROMPTS:
        done = engine.generate([Request(prompt, EAD(threshold=3.0, min_dwell=1), SamplingParams(max_tokens=40))])[0]
        assert done.text == engine.tokenizer.decode(list(done.token_ids), skip_special_tokens=True)
        events = list(engine.stream([Request(prompt, EAD(threshold=3.0, min_dwell=1), SamplingParams(max_tokens=40))]))
        assert "".join(e.text for e in events) == done.text
        assert len(events) == len(done.token_ids)
        assert [e.finish_reason is not None for e in events] == [False] * (len(events) - 1) + [True]


def test_same_seed_same_text_whatever_else_runs(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, max_tokens=30, seed=1234)
    request = Request("12+", EAD(threshold=3.0, min_dwell=2), params)
    first = engine.generate([request])[0]
    torch.rand(1000)  # disturb the global generator
    engine.generate([Request("noise", EAD(threshold=2.0), SamplingParams(temperature=1.0, seed=None))])
    second = engine.generate([request])[0]
    assert first.token_ids == second.token_ids and first.roles == second.roles
    other = engine.generate(
        [
            Request(
                "12+",
                EAD(threshold=3.0, min_dwell=2),
                SamplingParams(temperature=1.0, top_p=0.95, top_k=40, max_tokens=30, seed=99),
            )
        ]
    )[0]
    assert other.token_ids != first.token_ids


def test_rows_are_independent(engine: Engine) -> None:
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=5)
    policy = EAD(threshold=3.0, min_dwell=1)
    batch = engine.generate([Request(p, policy, params) for p in PROMPTS])
    alone0 = engine.generate([Request(PROMPTS[0], policy, params)])[0]
    assert batch[0].token_ids == alone0.token_ids
    swapped = engine.generate([Request("zzz", SmallOnly(), params), Request(PROMPTS[1], policy, params)])
    assert swapped[1].token_ids == batch[1].token_ids


def test_max_tokens_and_length_finish(engine: Engine) -> None:
    for n in (1, 7):
        done = engine.generate([Request("x", LargeOnly(), SamplingParams(max_tokens=n, ignore_eos=True))])[0]
        assert len(done.token_ids) == n and done.finish_reason is FinishReason.LENGTH
        assert done.cost.completion_tokens == n


def test_stop_strings_cut_text_exactly(engine: Engine) -> None:
    policy = EAD(threshold=3.0, min_dwell=1)
    checked = 0
    for prompt in PROMPTS:
        free = engine.generate([Request(prompt, policy, SamplingParams(max_tokens=40, ignore_eos=True))])[0]
        text = free.text
        if len(text) < 8:
            continue
        for stop in (text[3:6], text[5:7], text[-2:], "never-there"):
            done = engine.generate(
                [Request(prompt, policy, SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True))]
            )[0]
            cut = first_stop(text, [stop])
            assert done.text == (text if cut is None else text[:cut])
            assert stop not in done.text
            assert done.finish_reason is (FinishReason.LENGTH if cut is None else FinishReason.STOP)
            checked += 1
    assert checked >= 8


def test_context_window_is_enforced(engine: Engine) -> None:
    limit = engine.max_positions
    assert limit is not None
    long_ids = [5] * limit
    with pytest.raises(ValueError, match="positions"):
        engine.generate([Request(long_ids, SmallOnly())])
    done = engine.generate([Request([5] * (limit - 3), SmallOnly(), SamplingParams(max_tokens=50, ignore_eos=True))])[0]
    assert len(done.token_ids) == 3 and done.finish_reason is FinishReason.LENGTH


def test_bad_requests_are_refused_and_engine_keeps_working(engine: Engine) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([Request([10**6], SmallOnly())])
    with pytest.raises(ValueError, match="Request"):
        engine.generate(["just a string"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="policy"):
        Request("x", "ead")  # type: ignore[arg-type]
    ok = engine.generate([Request("12", SmallOnly(), SamplingParams(max_tokens=3))])
    assert len(ok[0].token_ids) >= 1


def test_empty_prompt_starts_from_bos(llama_pair: ModelPair) -> None:
    engine = Engine(llama_pair)
    assert engine.encode("") == [llama_pair.tokenizer.bos_token_id]
    done = engine.generate([Request("", SmallOnly(), SamplingParams(max_tokens=3))])[0]
    assert done.cost.prompt_tokens == 1


def test_characters_outside_the_vocabulary_are_named_in_a_warning() -> None:
    from ead_llm import EntropyAdaptiveLLM

    llm = EntropyAdaptiveLLM(max_tokens=2)
    with pytest.warns(UserWarning, match=r"outside the vocabulary, read as '<unk>': \['\?', 'h', 'w', 'y'\]"):
        llm.invoke("2+2= why?")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.invoke("4821+3907-1568\n")  # every character known: no warning


@pytest.mark.parametrize("native", [False, True], ids=["torch-attention", "own-attention"])
def test_long_rows_side_by_side_are_read_in_place_and_equal_generate(
    llama_pair: ModelPair, native: bool, monkeypatch: pytest.MonkeyPatch, packed: list[PackedBatch]
) -> None:
    """Four long prompts decoded together: their prefills attend in a prompt's chunks, and the scheduler keeps
    room after each row's blocks, so every later step reads each row's history where it lies (no row is ever
    copied into a batch: over views with torch's attention, through its block table with ead-llm's own); each still
    gives generate()'s tokens. (Rows count as long from 128 positions here: the tiny pair's context is 512.)"""
    from ead_llm.core import kernels, model_runner
    from ead_llm.core.model_runner import PromptAttention, RowAttention

    monkeypatch.setattr(model_runner, "VIEW_MIN", 128)
    if native and not kernels.available():
        pytest.skip("ead-llm's own kernel does not build here (no C compiler, or no AVX2 and FMA)")
    engine = Engine(llama_pair)
    for runner in engine.runners.values():
        runner.native_attention = native
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, llama_pair.vocab_size, (150 + 7 * i,), generator=gen).tolist() for i in range(4)]
    done = engine.generate([Request(p, LargeOnly(), SamplingParams(max_tokens=40)) for p in prompts])
    for prompt, completion in zip(prompts, done, strict=True):
        assert list(completion.token_ids) == hf_greedy(llama_pair, Role.LARGE, prompt, 40)
    units = [unit for batch in packed for unit in batch.alone]
    assert not any(batch.groups for batch in packed)
    fresh = [u for u in units if isinstance(u, PromptAttention)]
    views = [u for u in units if isinstance(u, RowAttention)]
    if native:
        assert len(fresh) == len(units) == 4 and sum(batch.native is not None for batch in packed) >= 5
        assert all(len(batch.native.meta) == 4 * 3 for batch in packed if batch.native is not None)  # 4 rows each
        engine.close()
        return
    assert len(fresh) == 4 and len(views) == len(units) - 4 >= 4 * 5
    assert all(isinstance(piece, slice) for u in views for piece in u.pieces)  # no copies
    engine.close()


def test_a_samples_logits_reach_the_decoders_that_read_them(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder that reads a sample's logits (every decoder, unless it says otherwise) gets its row of the pass's
    logits, also in a pass beside rows whose decoders do not read them. A pass where no decoder reads them gives
    None (a view per row costs a microsecond or two a step). The texts are the same either way."""
    from ead_llm.core.policy import Decoder
    from ead_llm.policies.switching import SwitchingDecoder

    class Reading(SwitchingDecoder):
        reads_logits = True

    seen: dict[bool, list[torch.Tensor | None]] = {True: [], False: []}
    on_token = SwitchingDecoder.on_token

    def record(self: SwitchingDecoder, seq, sample, room):
        seen[self.reads_logits].append(sample.logits)
        return on_token(self, seq, sample, room)

    monkeypatch.setattr(SwitchingDecoder, "on_token", record)
    alone = [done.text for done in engine.generate([Request(p, EAD(), SamplingParams(max_tokens=8)) for p in PROMPTS])]
    assert seen[False] and all(logits is None for logits in seen[False]) and not seen[True]
    assert Decoder.reads_logits and not SwitchingDecoder.reads_logits
    build = EAD.build_decoder
    reading = {1, 3}  # these rows' decoders read the logits
    made: list[int] = []

    def build_some_reading(self: EAD, key: int, call: dict) -> Decoder:  # type: ignore[type-arg]
        decoder = build(self, key, call)
        made.append(len(made))
        if made[-1] in reading:
            decoder.__class__ = Reading
        return decoder

    monkeypatch.setattr(EAD, "build_decoder", build_some_reading)
    seen[True].clear()
    seen[False].clear()
    mixed = [done.text for done in engine.generate([Request(p, EAD(), SamplingParams(max_tokens=8)) for p in PROMPTS])]
    assert mixed == alone
    assert seen[True] and all(isinstance(logits, torch.Tensor) for logits in seen[True])
    assert all(logits.shape == (engine.pair.vocab_size,) for logits in seen[True])  # type: ignore[union-attr]
