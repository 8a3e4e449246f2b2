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
    fresh = sum(1 for unit in alone if unit is not None and unit.span is None)
    views = sum(1 for unit in alone if unit is not None and unit.span is not None)
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
