import math

import pytest
import torch

from ead_llm.core.ops import (
    apply_temperature,
    entropy_bits,
    forward_flops,
    parameter_ratio,
    top_k_filter,
    top_p_filter,
)


def test_entropy_bits_hand_computed() -> None:
    uniform4 = torch.zeros(4)
    assert entropy_bits(uniform4).item() == pytest.approx(2.0)
    # p = (1/2, 1/4, 1/4): H = 0.5*1 + 2 * 0.25*2 = 1.5 bits
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    assert entropy_bits(logits).item() == pytest.approx(1.5)
    # one certain token, others masked: 0 bits, no NaN from 0 * log 0
    certain = torch.tensor([0.0, float("-inf"), float("-inf")])
    assert entropy_bits(certain).item() == 0.0


def test_entropy_is_shift_invariant_and_batched() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])  # [2, 3]
    out = entropy_bits(logits)
    assert out.shape == (2,)
    assert out[1].item() == pytest.approx(math.log2(3))
    assert entropy_bits(logits + 100.0)[0].item() == pytest.approx(out[0].item(), abs=1e-5)


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    kept = ~torch.isinf(top_p_filter(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    kept = ~torch.isinf(top_p_filter(logits, 0.8))
    assert kept.tolist() == [True, True, False, False]  # mass before 3rd token is 0.8 >= 0.8
    kept = ~torch.isinf(top_p_filter(logits, 0.81))
    assert kept.tolist() == [True, True, True, False]
    kept = ~torch.isinf(top_p_filter(logits, 0.01))
    assert kept.tolist() == [True, False, False, False]
    # order of the vocabulary does not matter
    perm = torch.tensor([2, 0, 3, 1])
    kept_perm = ~torch.isinf(top_p_filter(logits[perm], 0.7))
    assert kept_perm.tolist() == [False, True, False, True]


def test_top_p_keeps_a_tie_at_its_edge_together() -> None:
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])  # the edge of p = 0.5 falls inside the three-way tie
    kept = ~torch.isinf(top_p_filter(probs.log(), 0.5))
    assert kept.tolist() == [True, True, True, True]
    kept = ~torch.isinf(top_p_filter(probs.log(), 0.4))  # mass before the tie is 0.4: not below 0.4
    assert kept.tolist() == [True, False, False, False]
    flat = torch.zeros(2, 7)  # all equal: everything is the most likely
    assert not torch.isinf(top_p_filter(flat, 0.01)).any()
    masked = torch.tensor([[0.0, -math.inf, -math.inf, 1.0]])
    assert (~torch.isinf(top_p_filter(masked, 0.999))).tolist() == [[True, False, False, True]]


def test_top_k_keeps_ties_at_the_cut() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = ~torch.isinf(top_k_filter(logits, torch.tensor([2, 1, 0]), 2))
    assert kept.tolist() == [[True, True, True, True, False], [True] * 5, [True] * 5]


def test_temperature_scales_odds_and_survives_tiny_values() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert torch.softmax(apply_temperature(logits, 1.0), -1)[0].tolist() == pytest.approx([0.25, 0.75])
    # temperature 0.5 squares the odds: 1:9; per row as a tensor too
    assert torch.softmax(apply_temperature(logits, 0.5), -1)[0].tolist() == pytest.approx([0.1, 0.9])
    per_row = apply_temperature(logits.expand(2, 2), torch.tensor([[1.0], [0.5]]))
    assert torch.softmax(per_row, -1)[:, 1].tolist() == pytest.approx([0.75, 0.9])
    tiny = torch.softmax(apply_temperature(logits, 1e-300), -1)
    assert not tiny.isnan().any() and tiny[0].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(logits, 0.0)


def test_top_p_takes_a_threshold_per_row() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(2, 4)
    kept = ~torch.isinf(top_p_filter(logits, torch.tensor([[0.7], [0.81]])))
    assert kept.tolist() == [[True, True, False, False], [True, True, True, False]]


def test_parameter_ratio_formula() -> None:
    assert parameter_ratio(0.25, 1, 10) == pytest.approx(0.25 + 0.75 * 0.1)
    assert parameter_ratio(0.0, 3, 12) == pytest.approx(0.25)
    assert parameter_ratio(1.0, 3, 12) == 1.0
    with pytest.raises(ValueError, match="large_fraction"):
        parameter_ratio(1.5, 1, 2)


def test_forward_flops_hand_computed() -> None:
    # 3 new tokens after 2 cached: contexts 3, 4, 5 -> sum 12
    flops = forward_flops(new_tokens=3, past_tokens=2, non_embedding_params=100, num_layers=2, attention_width=8)
    assert flops == 2 * 100 * 3 + 4 * 2 * 8 * 12
    # one pass over 5 tokens equals five single-token passes (same contexts)
    one = forward_flops(new_tokens=5, past_tokens=0, non_embedding_params=7, num_layers=3, attention_width=4)
    steps = sum(
        forward_flops(new_tokens=1, past_tokens=p, non_embedding_params=7, num_layers=3, attention_width=4)
        for p in range(5)
    )
    assert one == steps
