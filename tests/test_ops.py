import math

import pytest
import torch

from ead_llm.core.ops import (
    entropy_bits,
    forward_flops,
    parameter_ratio,
    sample_token,
    sampling_probs,
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


def test_top_k_keeps_k_largest() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0])
    out = top_k_filter(logits, 2)
    assert torch.isinf(out[[0, 2]]).all()
    assert out[1] == 5.0 and out[3] == 4.0
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, 10), logits)


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


def test_sampling_probs_temperature() -> None:
    logits = torch.tensor([0.0, math.log(3.0)])
    assert sampling_probs(logits, 1.0, 0, 1.0).tolist() == pytest.approx([0.25, 0.75])
    # temperature 0.5 squares the odds: 1:9
    assert sampling_probs(logits, 0.5, 0, 1.0).tolist() == pytest.approx([0.1, 0.9])


def test_sample_greedy_and_seeded() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9])
    assert sample_token(logits, temperature=0.0, top_k=0, top_p=1.0, generator=None) == 1

    def draws(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=gen) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    # top_k=1 is greedy whatever the draw
    gen = torch.Generator().manual_seed(0)
    assert {sample_token(logits, temperature=2.0, top_k=1, top_p=1.0, generator=gen) for _ in range(30)} == {1}


def test_sampling_frequencies_match_probabilities() -> None:
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    gen = torch.Generator().manual_seed(0)
    counts = [0, 0, 0]
    n = 6000
    for _ in range(n):
        counts[sample_token(logits, temperature=1.0, top_k=0, top_p=1.0, generator=gen)] += 1
    for count, p in zip(counts, [0.2, 0.5, 0.3], strict=True):
        assert abs(count / n - p) < 0.025


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
