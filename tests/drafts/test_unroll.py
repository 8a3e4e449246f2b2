"""Training-time test: every pass of :func:`unrolled` is what the draft computes when it drafts that token of a
round, checked against the plain causal forward run on the inputs such a round gives it."""

from __future__ import annotations

import pytest
import torch

from ead_llm.drafts.model import FeatureDraft, FeatureDraftConfig, previous
from ead_llm.drafts.unroll import unrolled, window_mask


def _draft(layers: int) -> FeatureDraft:
    torch.manual_seed(0)
    config = FeatureDraftConfig(
        draft_vocab_size=40,
        num_hidden_layers=layers,
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return FeatureDraft(config).eval()


@pytest.mark.parametrize("layers", [1, 2])
def test_each_pass_is_the_draft_writing_that_token_of_a_round(layers: int) -> None:
    draft = _draft(layers)
    length, depth = 9, 3
    ids = torch.randint(0, 50, (2, length))
    features = previous(torch.randn(2, length, 32))
    with torch.no_grad():
        outs = unrolled(draft, ids, features, depth)
        torch.testing.assert_close(outs[0], draft.draft_forward(ids, features)[0])
        for start in range(length - depth + 1):  # a round that starts reading the target's feature at `start`
            reading = features.clone()
            for j in range(1, depth):  # its j-th token reads its own output one position back
                p = start + j
                reading[:, p] = draft.draft_forward(ids[:, :p], reading[:, :p])[0][:, -1]
                out = draft.draft_forward(ids[:, : p + 1], reading[:, : p + 1])[0]
                torch.testing.assert_close(outs[j][:, p], out[:, -1])


@pytest.mark.parametrize("layers", [1, 2])
def test_a_window_computes_what_the_whole_sequence_does_where_a_round_can_be_counted(layers: int) -> None:
    """Over each row's window (its answer), pass ``j`` at ``j`` or more positions in gives what the passes over
    the whole sequence give there; what the window skips (the prompt) changes none of it."""
    draft = _draft(layers)
    length, depth, width = 12, 3, 7
    ids = torch.randint(0, 50, (3, length))
    features = previous(torch.randn(3, length, 32))
    starts = torch.tensor([2, 5, 0])  # the second row's window runs past its end
    with torch.no_grad():
        whole = unrolled(draft, ids, features, depth)
        windowed = unrolled(draft, ids, features, depth, starts, width)
    for j in range(depth):
        assert windowed[j].shape == (3, width, 32)
        for row, start in enumerate(starts.tolist()):
            end = min(length, start + width)
            torch.testing.assert_close(windowed[j][row, j : end - start], whole[j][row, start + j : end])
    with pytest.raises(ValueError, match="width"):
        unrolled(draft, ids, features, depth, starts, 0)


def test_the_mask_reads_the_targets_past_and_the_rounds_own_positions() -> None:
    mask = window_mask(torch.arange(5)[None], 5, 2)[0, 0]
    assert mask.shape == (5, 15)
    assert torch.equal(window_mask(torch.arange(5)[None], 5, 0)[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())
    # pass 2 at position 4: pass 0 up to 2, pass 1 at 3, pass 2 at 4
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    # a window of positions 3 and 4: pass 1 at 4 reads pass 0 up to 3 and pass 1 at 4 (the window's second key)
    assert window_mask(torch.tensor([[3, 4]]), 5, 1)[0, 0, 1].nonzero().flatten().tolist() == [0, 1, 2, 3, 5 + 1]
    with pytest.raises(ValueError, match="depth"):
        unrolled(_draft(1), torch.zeros((1, 3), dtype=torch.long), torch.zeros(1, 3, 32), 0)
