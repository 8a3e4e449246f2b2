"""The model runner: packed passes over the paged cache give the model's own logits; faults are bisected."""

from __future__ import annotations

import pytest
import torch

from ead_llm.core import model_runner
from ead_llm.core.kv_cache import KVCache, SequenceKV
from ead_llm.core.loading import ModelPair
from ead_llm.core.model_runner import ModelRunner, PassRow
from ead_llm.core.types import Role


def _runner(pair: ModelPair) -> ModelRunner:
    loaded = pair.model(Role.LARGE)
    return ModelRunner(
        loaded, pair.device, pair.vocab_size, KVCache(loaded.model.config.num_hidden_layers, block_size=4)
    )


@torch.inference_mode()
@pytest.mark.parametrize("in_place", [True, False], ids=["views", "gathers"])
def test_packed_passes_match_the_models_own_logits(
    pair: ModelPair, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows attended over views of their blocks (every row here, with room kept after each) and rows copied
    into a batch (none here) give the model's own logits; so do prefills over the pass's own keys."""
    monkeypatch.setattr(model_runner, "VIEW_MIN", 0 if in_place else 10**9)
    if not in_place:  # a last row alone would otherwise be read over views of its stretches
        monkeypatch.setattr(model_runner, "MAX_STRETCHES", 1)
    alone = []
    original = ModelRunner._alone
    monkeypatch.setattr(ModelRunner, "_alone", lambda self, *a, **k: alone.append(original(self, *a, **k)) or alone[-1])
    runner = _runner(pair)
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
    fresh = sum(1 for unit in alone if unit is not None and unit.spans is None)
    views = sum(1 for unit in alone if unit is not None and unit.spans is not None)
    assert fresh == len(seqs)  # the first pass: no history to read
    assert views == (len(alone) - fresh if in_place else 0) and (views > 20 or not in_place)
    # the model still runs outside the engine (its attention falls back to SDPA)
    assert runner.model.generate(torch.tensor([seqs[0][:3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)


@torch.inference_mode()
def test_a_gathered_row_reads_only_its_own_slots(pair: ModelPair) -> None:
    """Short rows copied into one batched call read nothing of the cache but their own positions: with every
    other slot poisoned (NaN, as a broken neighbour or uninitialised storage would leave it), including the
    rest of their own last block and the blocks a shorter row's table is padded to, their logits are the
    model's own."""
    runner = _runner(pair)
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


def test_a_failing_row_is_isolated_and_the_rest_run(llama_pair: ModelPair, monkeypatch: pytest.MonkeyPatch) -> None:
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
    monkeypatch.undo()
    alone = runner.execute([PassRow(kvs[2], seqs[2])])
    assert alone.failures == {} and kvs[2].length == 4


def test_a_row_must_feed_what_it_reads(llama_pair: ModelPair) -> None:
    runner = _runner(llama_pair)
    kv = SequenceKV()
    runner.cache.reserve(kv, 2)
    out = runner.execute([PassRow(kv, [5, 6], read=3)])
    assert "reads 3 positions but feeds 2" in str(out.failures[0])


def test_stretches_of_a_block_table() -> None:
    """A table's blocks in order are one stretch; out of order, each run of consecutive blocks is one, and a
    table in more pieces than the limit has none (it is copied instead)."""
    assert model_runner.stretches([5, 6, 7, 9], 3) == [(5, 3)]
    assert model_runner.stretches([5, 6, 2, 3, 9], 5) == [(5, 2), (2, 2), (9, 1)]
    assert model_runner.stretches([4, 3, 2, 1], 4, limit=3) is None
    assert model_runner.stretches([4, 3, 2, 1], 4, limit=4) == [(4, 1), (3, 1), (2, 1), (1, 1)]


@torch.inference_mode()
@pytest.mark.parametrize("limit", [8, 2], ids=["views-of-stretches", "too-many-pieces"])
def test_a_row_in_stretches_is_read_in_place(pair: ModelPair, limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose blocks lie in several stretches (as a prompt that took cached blocks does) is attended over a
    view of each, with no copy, and gives the model's own logits, one token at a time and three at a time; in
    more pieces than the limit it is copied and gives the same."""
    monkeypatch.setattr(model_runner, "MAX_STRETCHES", limit)
    units: list = []
    original = ModelRunner._alone
    monkeypatch.setattr(ModelRunner, "_alone", lambda self, *a, **k: units.append(original(self, *a, **k)) or units[-1])
    runner = _runner(pair)
    holder = SequenceKV()
    runner.cache.reserve(holder, 48)  # 12 blocks of 4, then handed out in three stretches
    held = holder.blocks
    blocks = held[8:12] + held[0:3] + held[6:8] + held[3:6]  # positions 0-15, 16-27, 28-35, 36-47
    tokens = torch.randint(4, pair.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    want = runner.model(input_ids=torch.tensor([tokens])).logits[0, :, : pair.vocab_size].float()
    kv = SequenceKV(blocks=list(blocks))
    runner.execute([PassRow(kv, tokens[:12])])
    end = 12
    ends = []
    while end < len(tokens):
        step = 1 if end < 26 else 3
        end = min(len(tokens), end + step)
        ends.append(end)
        got = runner.execute([PassRow(kv, tokens[:end], read=end - kv.length)]).rows(0)
        assert torch.allclose(got, want[end - got.shape[0] : end], atol=1e-4)
    assert units[0].spans is None  # the prefill attends over its own keys
    pieces = [1 if e <= 16 else 2 if e <= 28 else 3 if e <= 36 else 4 for e in ends]
    assert max(pieces) == 4
    # every later pass over a view of each stretch, or, in more pieces than the limit, copied as before
    assert [None if u is None else len(u.spans) for u in units[1:]] == [p if p <= limit else None for p in pieces]


def _reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Plain attention of queries ``[1, H, W, D]`` over all of ``[1, Hkv, L, D]``, each group's heads repeated."""
    group = query.shape[1] // keys.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    weights = (query.double() @ k.transpose(-1, -2) / query.shape[-1] ** 0.5).softmax(dim=-1)
    return (weights @ v).to(query.dtype)


@torch.inference_mode()
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["grouped", "one-per-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_query_over_views_and_stretches(heads: tuple[int, int], dtype: torch.dtype) -> None:
    """One decode query over a view of a head-major cache and over stretches of it (merged by each stretch's
    log-sum-exp, a stretch as short as one position) gives plain attention over the joined positions."""
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


@pytest.mark.xfail(
    strict=True,
    reason="known defect (2026-12-05): a short row decoding beside others is attended in a gathered, padded group "
    "(SDPA with a mask over the longest row's keys), alone over a view of its own keys; the two sum in another order "
    "and its logits differ in the last bits (about 6e-6 here), so a near-tie can flip a greedy token with the batch",
)
@torch.inference_mode()
def test_a_rows_decode_logits_are_the_same_alone_and_beside_other_rows(llama_pair: ModelPair) -> None:
    """Rows of several lengths prefilled together, then one decode pass (1 and 4 positions read): each row's logits
    are those it gets when it runs the same two passes alone."""
    loaded = llama_pair.model(Role.LARGE)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, llama_pair.vocab_size, (n,), generator=gen).tolist() for n in (12, 30, 7, 45, 20)]

    def run(texts: list[list[int]], read: int) -> list[torch.Tensor]:
        runner = ModelRunner(
            loaded,
            llama_pair.device,
            llama_pair.vocab_size,
            KVCache(loaded.model.config.num_hidden_layers, block_size=16),
        )
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
