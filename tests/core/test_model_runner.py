"""The model runner: packed passes over the paged cache give the model's own logits; faults are bisected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ead_llm.core import kernels, model_runner
from ead_llm.core.kv_cache import KVCache, SequenceKV
from ead_llm.core.loading import LoadedModel, ModelInfo, ModelPair
from ead_llm.core.model_runner import ModelRunner, PackedBatch, PassRow, PromptAttention, RowAttention
from ead_llm.core.types import Role

NATIVE = pytest.mark.parametrize("native", [False, True], ids=["torch-attention", "own-attention"])
"""Run a test over torch's attention paths and over ead-llm's own attention kernel."""


def _runner(pair: ModelPair, *, native: bool = False, block_size: int = 4) -> ModelRunner:
    """A runner of ``pair``'s large model; ``native``: its queries past the prompts through ead-llm's own attention
    kernel (torch's paths otherwise, which most tests here look into)."""
    loaded = pair.model(Role.LARGE)
    runner = ModelRunner(
        loaded, pair.device, pair.vocab_size, KVCache(loaded.model.config.num_hidden_layers, block_size=block_size)
    )
    if native and not kernels.available():
        pytest.skip("ead-llm's own kernel does not build here (no C compiler, or no AVX2 and FMA)")
    assert runner.native_attention == (kernels.available() and runner._fused is not None)
    runner.native_attention = native
    return runner


@torch.inference_mode()
@pytest.mark.parametrize("as_decode", [True, False], ids=["as-decode-steps", "together"])
@pytest.mark.parametrize("path", ["views", "gathers", "native"])
def test_packed_passes_match_the_models_own_logits(
    pair: ModelPair, path: str, as_decode: bool, monkeypatch: pytest.MonkeyPatch, packed: list[PackedBatch]
) -> None:
    """Queries attended alone over views of their rows' blocks (every row here, with room kept after each),
    queries batched by padded length, and queries run by ead-llm's own attention kernel where the cache holds their
    keys give the model's own logits; so do prefills (a prompt's chunks), and rows whose new tokens attend
    together (without exact verification, every row feeding several)."""
    in_place = path == "views"
    monkeypatch.setattr(model_runner, "VIEW_MIN", 0 if in_place else 10**9)
    if path == "native" and pair.model(Role.LARGE).model.config.model_type != "llama":
        assert not _runner(pair).native_attention  # transformers' modules: torch's attention
        return
    runner = _runner(pair, native=path == "native")
    runner.exact_verification = as_decode
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, pair.vocab_size, (n,), generator=gen).tolist() for n in (7, 13, 3, 21)]
    want = [runner.model(input_ids=torch.tensor([s])).logits[0, :, : pair.vocab_size].float() for s in seqs]
    kvs = [SequenceKV() for _ in seqs]
    fed = [2, 5, 1, 9]  # a first pass of prefills of different lengths
    for step in range(30):  # then rows that feed one token (decode) or three (catch-up), together
        rows, where = [], []
        for i, (kv, tokens) in enumerate(zip(kvs, seqs, strict=True)):
            target = fed[i] if step == 0 else min(len(tokens), kv.length + (1 if i % 2 else 3))
            if target > kv.length:
                runner.cache.reserve(kv, target, expect=len(tokens) if in_place else None)
                rows.append(PassRow(kv, tokens[:target], read=min(2, target - kv.length)))
                where.append((i, target))
        if not rows:
            break
        out = runner.execute(rows)
        assert out.logits.shape[0] == sum(r.read for r in rows)  # only the positions read
        for r, (i, target) in enumerate(where):
            got = out.rows(r)
            assert torch.allclose(got, want[i][target - got.shape[0] : target], atol=1e-4)
    assert all(kv.length == len(tokens) for kv, tokens in zip(kvs, seqs, strict=True))
    assert runner.retried_passes == 0  # no pass failed and was bisected
    alone = [unit for batch in packed for unit in batch.alone]
    fresh = sum(1 for unit in alone if isinstance(unit, PromptAttention))
    read = [unit for unit in alone if isinstance(unit, RowAttention)]
    batched = sum(len(group.mask) for batch in packed for group in batch.groups)
    assert fresh == len(seqs)  # the first pass: no history to read
    if path == "native":  # every query past the prompts, whether or not verification is exact
        assert not read and not batched
        assert sum(len(batch.native.meta) for batch in packed if batch.native is not None) > 40
        return
    together = [unit for unit in read if unit.mask is not None]  # a row's new tokens alone, under one mask
    wide = [group for batch in packed for group in batch.groups if group.mask.shape[2] > 1]  # ... or in a group
    if not as_decode:
        assert len(together) >= 3 if in_place else len(wide) >= 3 and not together
    elif in_place:  # every row alone, over views
        assert len(read) > 20 and batched == 0 and all(isinstance(p, slice) for unit in read for p in unit.pieces)
    else:  # every query short: batched with those of its padded length
        assert batched > 20 and not read
    # the model still runs outside the engine (its attention falls back to SDPA)
    assert runner.model.generate(torch.tensor([seqs[0][:3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)


@torch.inference_mode()
@NATIVE
def test_a_gathered_row_reads_only_its_own_slots(pair: ModelPair, native: bool) -> None:
    """Short rows copied into one batched call read nothing of the cache but their own positions: with every
    other slot poisoned (NaN, as a broken neighbour or uninitialised storage would leave it), including the
    rest of their own last block and the blocks a shorter row's table is padded to, their logits are the
    model's own. So are those of rows ead-llm's own attention kernel reads where they lie."""
    if native and pair.model(Role.LARGE).model.config.model_type != "llama":
        return  # (above: such a model never takes the kernel)
    runner = _runner(pair, native=native)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, pair.vocab_size, (n,), generator=gen).tolist() for n in (5, 14, 9)]
    want = [runner.model(input_ids=torch.tensor([s])).logits[0, -1, : pair.vocab_size].float() for s in seqs]
    kvs = [SequenceKV() for _ in seqs]
    for kv, tokens in zip(kvs, seqs, strict=True):  # each prefilled alone, all but its last token
        runner.cache.reserve(kv, len(tokens))
        runner.execute([PassRow(kv, tokens[:-1])])
    size = runner.cache.block_size
    owned = {kv.blocks[p // size] * size + p % size for kv in kvs for p in range(kv.length)}
    for tensor in (*runner.cache.keys, *runner.cache.values):
        poison = torch.ones(tensor.shape[1], dtype=torch.bool)
        poison[sorted(owned)] = False
        tensor[:, poison] = float("nan")
    out = runner.execute([PassRow(kv, tokens) for kv, tokens in zip(kvs, seqs, strict=True)])  # decodes, gathered
    for r, expected in enumerate(want):
        assert torch.allclose(out.rows(r)[-1], expected, atol=1e-4)


def test_a_failing_row_is_isolated_and_the_rest_run(
    llama_pair: ModelPair, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runner = _runner(llama_pair)
    seqs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    kvs = [SequenceKV() for _ in seqs]
    for kv, tokens in zip(kvs, seqs, strict=True):
        runner.cache.reserve(kv, len(tokens))
    original = runner._run

    def run(rows):
        if any(list(row.tokens) == [10, 11, 12, 13] for row in rows):
            raise RuntimeError("bad row")
        return original(rows)

    monkeypatch.setattr(runner, "_run", run)
    out = runner.execute([PassRow(kv, tokens) for kv, tokens in zip(kvs, seqs, strict=True)])
    assert list(out.failures) == [2] and str(out.failures[2]) == "bad row"
    assert sorted(out.work) == [0, 1, 3] and [kv.length for kv in kvs] == [3, 2, 0, 1]
    assert runner.retried_passes == 2  # 4 rows, then the half with the bad row
    warned = [r for r in caplog.records if r.name == "ead_llm.core.model_runner"]
    assert len(warned) == 1 and "pass of 4 rows failed (RuntimeError: bad row)" in warned[0].getMessage()  # once
    monkeypatch.undo()
    alone = runner.execute([PassRow(kvs[2], seqs[2])])
    assert alone.failures == {} and kvs[2].length == 4


def test_a_row_must_feed_what_it_reads(llama_pair: ModelPair) -> None:
    runner = _runner(llama_pair)
    kv = SequenceKV()
    runner.cache.reserve(kv, 2)
    out = runner.execute([PassRow(kv, [5, 6], read=3)])
    assert "reads 3 positions but feeds 2" in str(out.failures[0])


def test_a_rows_history_is_cut_at_fixed_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of SPLIT positions whatever the block table: a range where a piece's blocks lie in order, else its
    slots."""
    monkeypatch.setattr(model_runner, "SPLIT", 8)
    runner = object.__new__(ModelRunner)
    runner.cache, runner.device = KVCache(1, block_size=4), torch.device("cpu")
    pieces = runner._pieces([5, 6, 2, 3, 9], 19)  # positions 0-7 in blocks 5, 6; 8-15 in 2, 3; 16-18 in 9
    assert pieces[:2] == (slice(20, 28), slice(8, 16)) and pieces[2] == slice(36, 39)
    pieces = runner._pieces([5, 7, 8, 9], 14)  # 0-7: blocks 5 and 7, apart; 8-13: 8, 9
    assert pieces[0].tolist() == [20, 21, 22, 23, 28, 29, 30, 31] and pieces[1] == slice(32, 38)
    assert runner._pieces([1], 3) == (slice(4, 7),)


@torch.inference_mode()
@pytest.mark.parametrize("split", [512, 16], ids=["one-piece", "pieces-of-16"])
@NATIVE
def test_a_row_reads_the_same_bits_wherever_its_blocks_lie(
    llama_pair: ModelPair, split: int, native: bool, monkeypatch: pytest.MonkeyPatch, packed: list[PackedBatch]
) -> None:
    """A row whose blocks lie in several stretches (as a prompt that took cached blocks does) gives the model's own
    logits, one token at a time and three at a time, and the same bits as the same row in blocks in order: its
    pieces are cut at the same positions, read over views where they lie in order, copied where not."""
    monkeypatch.setattr(model_runner, "VIEW_MIN", 0)  # decode rows alone too, as long rows are
    monkeypatch.setattr(model_runner, "SPLIT", split)
    runner = _runner(llama_pair, native=native)
    holder = SequenceKV()
    runner.cache.reserve(holder, 48)  # 12 blocks of 4, then handed out in three stretches
    held = holder.blocks
    scattered = held[8:12] + held[0:3] + held[6:8] + held[3:6]  # positions 0-15, 16-27, 28-35, 36-47
    in_order = SequenceKV()
    runner.cache.reserve(in_order, 48)
    tokens = torch.randint(4, llama_pair.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    want = runner.model(input_ids=torch.tensor([tokens])).logits[0, :, : llama_pair.vocab_size].float()
    kvs = [SequenceKV(blocks=list(scattered)), in_order]
    for kv in kvs:
        runner.execute([PassRow(kv, tokens[:12])])
    end = 12
    while end < len(tokens):
        end = min(len(tokens), end + (1 if end < 26 else 3))
        got = [runner.execute([PassRow(kv, tokens[:end], read=end - kv.length)]).rows(0) for kv in kvs]
        assert torch.allclose(got[0], want[end - got[0].shape[0] : end], atol=1e-4)
        assert torch.equal(got[0], got[1])
    assert isinstance(packed[0].alone[0], PromptAttention)  # the prefill: a prompt's chunks
    if native:  # every later query through the kernel, over the cache where it lies
        assert all(batch.native is not None and not batch.alone and not batch.groups for batch in packed[2:])
        return
    copied = [p for batch in packed[2::2] for u in batch.alone for p in u.pieces if isinstance(p, torch.Tensor)]
    assert copied and all(isinstance(p, slice) for batch in packed[3::2] for u in batch.alone for p in u.pieces)


def _reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Plain attention of queries ``[1, H, W, D]`` over all of ``[1, Hkv, L, D]``, each group's heads repeated."""
    group = query.shape[1] // keys.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    weights = (query.double() @ k.transpose(-1, -2) / query.shape[-1] ** 0.5).softmax(dim=-1)
    return (weights @ v).to(query.dtype)


@torch.inference_mode()
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["grouped", "one-per-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_query_over_views_and_pieces(heads: tuple[int, int], dtype: torch.dtype) -> None:
    """One decode query over a view of a head-major cache and over pieces of it (merged by each piece's
    log-sum-exp, a piece as short as one position) gives plain attention over the joined positions."""
    query_heads, kv_heads = heads
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(kv_heads, 300, 64, generator=gen).to(dtype)  # [Hkv, slots, D], as the cache stores them
    values = torch.randn(kv_heads, 300, 64, generator=gen).to(dtype)
    query = torch.randn(1, 1, query_heads, 64, generator=gen).to(dtype).transpose(1, 2)  # [1, H, 1, D], strided
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for spans in ([slice(0, 200)], [slice(100, 260), slice(7, 8), slice(280, 299)], [slice(0, 64), slice(64, 65)]):
        views = [(keys[:, s][None], values[:, s][None]) for s in spans]
        joined = [torch.cat([view[i] for view in views], dim=2) for i in (0, 1)]
        want = _reference_attention(query, *joined)
        got = (
            model_runner.attention(query, *views[0], None, None)
            if len(spans) == 1
            else model_runner.split_attention(query, views, None, None)
        )
        assert got.shape == want.shape == (1, query_heads, 1, 64) and got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), atol=tol), (spans, (got - want).abs().max())


def test_a_pass_writes_its_slots_as_a_range_only_where_they_are_consecutive() -> None:
    assert model_runner.consecutive([7]) == slice(7, 8)
    assert model_runner.consecutive([4, 5, 6, 7]) == slice(4, 8)
    assert model_runner.consecutive([4, 6, 5, 7]) is None  # the ends match, the order does not
    assert model_runner.consecutive([4, 5, 9]) is None
    assert model_runner.consecutive([9, 5]) is None


@torch.inference_mode()
@pytest.mark.parametrize("view_min", [512, 100], ids=["short-rows", "some-rows-alone"])
@NATIVE
def test_a_rows_decode_logits_are_the_same_alone_and_beside_other_rows(
    llama_pair: ModelPair, view_min: int, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of several lengths (in several padded lengths, some past VIEW_MIN) prefilled together, then one decode
    pass (1 and 4 positions read): each row's logits are the bits it gets when it runs the same two passes alone,
    where its blocks lie elsewhere."""
    monkeypatch.setattr(model_runner, "VIEW_MIN", view_min)
    monkeypatch.setattr(model_runner, "SPLIT", 64)
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 17, 30, 44, 9, 12, 30, 7, 45, 20, 127, 131, 200)
    rows = [torch.randint(4, llama_pair.vocab_size, (n,), generator=gen).tolist() for n in lengths]

    def run(texts: list[list[int]], read: int) -> list[torch.Tensor]:
        runner = _runner(llama_pair, native=native, block_size=16)
        kvs = [SequenceKV() for _ in texts]
        for kv, text in zip(kvs, texts, strict=True):
            runner.cache.reserve(kv, len(text))
        runner.execute([PassRow(kv, text[:-read]) for kv, text in zip(kvs, texts, strict=True)])
        out = runner.execute([PassRow(kv, text, read) for kv, text in zip(kvs, texts, strict=True)])
        return [out.logits[out.start[i] : out.start[i] + read] for i in range(len(texts))]

    for read in (1, 4):
        together = run(rows, read)
        for i, text in enumerate(rows):
            assert torch.equal(run([text], read)[0], together[i])


@torch.inference_mode()
@NATIVE
def test_a_row_alone_reads_finite_numbers_past_its_end_whatever_its_blocks_held(
    llama_pair: ModelPair, native: bool
) -> None:
    """A row alone is read over a view padded to its last block's end (masked). Blocks a broken sequence left full
    of NaN are zeroed when handed out again, so the next holder's logits are the model's own."""
    runner = _runner(llama_pair, native=native)
    broken = SequenceKV()
    runner.cache.reserve(broken, 64)
    runner.execute([PassRow(broken, list(range(4, 68)))])
    for tensor in (*runner.cache.keys, *runner.cache.values):
        tensor.fill_(float("nan"))  # whatever it left, storage included
    left = set(broken.blocks)
    runner.cache.free(broken)
    tokens = torch.randint(4, llama_pair.vocab_size, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    want = runner.model(input_ids=torch.tensor([tokens])).logits[0, :, : llama_pair.vocab_size].float()
    kv = SequenceKV()
    runner.cache.reserve(kv, model_runner.BUCKET)  # blocks up to the padded length: read over a view
    assert set(kv.blocks) <= left
    runner.execute([PassRow(kv, tokens[:6])])
    for end in range(7, len(tokens) + 1):  # one row alone, decoding, 10 positions in blocks of 4
        got = runner.execute([PassRow(kv, tokens[:end])]).rows(0)[-1]
        assert torch.allclose(got, want[end - 1], atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("as_decode", [True, False], ids=["as-decode-steps", "together"])
def test_rows_feeding_as_many_tokens_at_the_same_padded_length_fill_one_group(
    llama_pair: ModelPair, as_decode: bool, packed: list[PackedBatch]
) -> None:
    """Three rows of one padded length each feeding three tokens: one group holding every query of the pass (three
    rows of three), or with exact verification one group per row (three single queries sharing its keys). Each row
    gets the model's own logits, and no pass fails (a failing pass is bisected into passes that succeed, which
    would hide it)."""
    runner = _runner(llama_pair)
    runner.exact_verification = as_decode
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(4, llama_pair.vocab_size, (n,), generator=gen).tolist() for n in (20, 21, 22)]
    want = [runner.model(input_ids=torch.tensor([s])).logits[0, :, : llama_pair.vocab_size].float() for s in seqs]
    kvs = [SequenceKV() for _ in seqs]
    for kv, tokens in zip(kvs, seqs, strict=True):
        runner.cache.reserve(kv, len(tokens))
        runner.execute([PassRow(kv, tokens[:-3])])
    out = runner.execute([PassRow(kv, tokens, read=3) for kv, tokens in zip(kvs, seqs, strict=True)])
    assert runner.retried_passes == 0 and not out.failures
    groups = packed[-1].groups
    assert not packed[-1].alone
    if as_decode:
        assert [g.mask.shape[:3] for g in groups] == [(3, 1, 1)] * 3
        assert all(g.key_slots is not None and g.key_slots.shape[0] == 1 for g in groups)  # one copy per row
    else:
        assert len(groups) == 1 and groups[0].query_index is None and groups[0].mask.shape[:3] == (3, 1, 3)
    for r in range(len(seqs)):
        torch.testing.assert_close(out.rows(r), want[r][-3:], atol=1e-4, rtol=1e-4)


def test_attention_runs_on_one_thread_where_more_would_give_a_row_other_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU's fused attention gives a row alone other bits than beside others at this thread count (an AMD
    Zen 3 at 2 threads), attention runs on one thread and the count comes back after; elsewhere nothing changes. A
    call for one row attended alone runs on every thread either way."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen: list[int] = []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def counted(*args: object, **kwargs: object) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return sdpa(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
        q, k, v = (torch.randn(1, 2, n, 8) for n in (1, 5, 5))
        for alike, threads in ((False, 1), (True, 2)):
            monkeypatch.setattr(model_runner, "_ROWS_ALIKE", {2: alike})
            model_runner.attention(q, k, v, None, None)
            assert seen[-1] == threads and torch.get_num_threads() == 2
            model_runner.attention(q, k, v, None, None, alone=True)  # a row attended alone: its shape is its own
            assert seen[-1] == 2
    finally:
        torch.set_num_threads(before)


def test_the_row_probe_finds_a_kernel_that_differs_only_over_long_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose lone rows get other bits only past 256 keys (as one that splits a long row's keys among threads
    would) is found out: the probe reads a grouped row's longest keys too, not only short ones. The stand-in kernel
    works each batch entry alone (so its rows agree by construction) and shifts lone rows over long keys."""

    def kernel(shift: float) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            out = torch.cat([scores[b : b + 1].softmax(-1) @ v[b : b + 1] for b in range(q.shape[0])])
            if q.shape[0] == 1 and k.shape[2] > 256:
                out = out + shift
            return out, scores.logsumexp(-1)

        return attend

    for shift, alike in ((0.0, True), (1e-6, False)):
        monkeypatch.setattr(model_runner, "_ROWS_ALIKE", {})
        monkeypatch.setattr(model_runner, "_CPU_ATTENTION", kernel(shift))
        assert model_runner.rows_alike(2) is alike


def _biased_llama(seed: int) -> LoadedModel:
    """A Llama of grouped heads with biases on every projection (as Qwen2's q, k and v have), in the shapes a
    runner takes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        for parameter in model.parameters():  # biases and norms away from their zeros and ones
            parameter.data.add_(0.05 * torch.randn_like(parameter))
    info = ModelInfo("biased-llama", 0, 0, config.num_hidden_layers, config.hidden_size, None)
    return LoadedModel(Role.LARGE, model, info)


@torch.inference_mode()
@pytest.mark.parametrize("threads", [1, 2], ids=["one-thread", "two-threads"])
@pytest.mark.parametrize("model", ["tiny-pair", "biased-grouped"])
def test_decode_passes_run_every_layer_in_one_kernel_call_with_the_bits_of_one_call_per_operation(
    llama_pair: ModelPair, model: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass whose every query is a decode step over the cache (decodes, catch-ups of a few tokens, several rows)
    runs all of its model's layers in one call of the kernel (:func:`ead_llm.core.kernels.layers`), and gives the
    logits, and writes the keys, that the layers one operation at a time give, to the bit, on one thread or two
    (the kernel's helpers); a pass with a prompt in it runs the layers one by one. Where the kernel's weights change (a
    projection put on another kernel and back), the call's table is built again."""
    if not kernels.available():
        pytest.skip("ead-llm's own kernel does not build here (no C compiler, or no AVX2 and FMA)")
    loaded = llama_pair.model(Role.LARGE) if model == "tiny-pair" else _biased_llama(0)
    vocab = llama_pair.vocab_size if model == "tiny-pair" else 96
    runners = [ModelRunner(loaded, torch.device("cpu"), vocab, KVCache(len(loaded.model.model.layers))) for _ in "ab"]
    whole, by_operation = runners
    assert whole._fused is not None and by_operation._fused is not None and whole.native_attention
    for runner in runners:  # whichever kernel timing chose here for these shapes: ours
        assert all(p.use("native") for p in runner._fused.projections)
    by_operation._fused.one_call = False
    calls: list[int] = []
    real = kernels.layers

    def counted(table: Any, hidden: torch.Tensor, *args: Any) -> None:
        calls.append(hidden.shape[0])
        real(table, hidden, *args)

    monkeypatch.setattr(kernels, "layers", counted)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in (40, 36, 29)]
    kvs = {runner: [SequenceKV() for _ in seqs] for runner in runners}
    fed, tables = [], []
    for step in range(12):
        if step == 6:  # the weights move: off the kernel and back (new packed copies, the same values)
            for p in whole._fused.projections:
                assert p.use(None) and p.use("native")
        outs = []
        for runner in runners:
            rows = []
            for i, (kv, tokens) in enumerate(zip(kvs[runner], seqs, strict=True)):
                target = (5, 9, 3)[i] if step == 0 else kv.length + 1 + (step + i) % 3  # 1 to 3 tokens a row
                runner.cache.reserve(kv, target)
                rows.append(PassRow(kv, tokens[:target], read=target - kv.length))
            before = torch.get_num_threads()
            torch.set_num_threads(threads)  # (torch's prompt attention may round otherwise on two threads)
            try:
                outs.append(runner.execute(rows))
            finally:
                torch.set_num_threads(before)
            assert not outs[-1].failures, outs[-1].failures
        fed.append(sum(row.read for row in rows))
        tables.append(whole._fused._table)
        assert torch.equal(outs[0].logits, outs[1].logits), (step, (outs[0].logits - outs[1].logits).abs().max())
    assert calls == fed[1:]  # every pass after the prompts', in one call; the prompts' one operation at a time
    assert tables[5][0] is tables[1][0] and tables[6][0] is not tables[5][0]  # built once, again once moved
    for layer in range(len(loaded.model.model.layers)):
        for stored in ("keys", "values"):
            mine, theirs = (getattr(runner.cache, stored)[layer] for runner in runners)
            assert torch.equal(mine, theirs)
    for i, (kv, tokens) in enumerate(zip(kvs[whole], seqs, strict=True)):  # and they are the model's own logits
        want = loaded.model(input_ids=torch.tensor([tokens[: kv.length]])).logits[0, -1, :vocab]
        assert torch.allclose(outs[0].rows(i)[-1], want, atol=1e-4)


@torch.inference_mode()
def test_the_one_call_layers_refuse_a_slot_outside_the_cache_and_inputs_they_would_read_past() -> None:
    """A write slot past the storage (a cache cleared under a pass) is refused before any layer runs, and so is an
    input of another shape, type or layout than the kernel reads: the storage and the hidden states are as they
    were."""
    if not kernels.available():
        pytest.skip("ead-llm's own kernel does not build here (no C compiler, or no AVX2 and FMA)")
    loaded = _biased_llama(1)
    runner = ModelRunner(loaded, torch.device("cpu"), 96, KVCache(3))
    assert runner._fused is not None and all(p.use("native") for p in runner._fused.projections)
    kv = SequenceKV()
    runner.cache.reserve(kv, 6)
    runner.execute([PassRow(kv, list(range(4, 9)))])  # a prompt: the storage exists
    first = runner._fused.layers[0]
    table = runner._fused._build_table()
    storage = [runner.cache.storage(layer, torch.empty(0, first.kv_heads, first.head_dim)) for layer in range(3)]
    before = [t.clone() for pair in storage for t in pair]
    capacity = storage[0][0].shape[1]
    hidden = torch.randn(1, 48)
    kept = hidden.clone()
    turn = (torch.ones(1, first.head_dim), torch.zeros(1, first.head_dim))
    where = (torch.tensor([kv.blocks[0]]), torch.tensor([[0, 6, -1]]), runner.cache.block_size, first.scaling)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.layers(table, hidden, (6, 2, 8), turn, storage, torch.tensor([capacity]), where)

    def call(**bad: Any) -> None:
        args = {"hidden": hidden, "turn": turn, "storage": storage, "slots": torch.tensor([0]), "where": where} | bad
        kernels.layers(table, args["hidden"], (6, 2, 8), args["turn"], args["storage"], args["slots"], args["where"])

    for bad in (  # what the kernel would read past: refused before it runs
        {"storage": storage[:2]},
        {"slots": torch.tensor([0], dtype=torch.int32)},
        {"turn": (torch.ones(2, first.head_dim), torch.zeros(2, first.head_dim))},
        {"where": (where[0], torch.tensor([[0, 6, -1], [0, 6, -1]]), *where[2:])},
        {"hidden": hidden.double()},
    ):
        with pytest.raises(ValueError, match="layers"):
            call(**bad)
    assert torch.equal(hidden, kept)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in storage for t in pair], strict=True))
    call()  # each refusal above is its own change's: the call as given runs
    assert not torch.equal(hidden, kept)
