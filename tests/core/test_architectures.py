"""Which transformers families load and run: a tiny random model of each, against its own generate().

Full-attention families run (Llama, Qwen2, Qwen3, Mistral v0.3, Phi-3 without a window, GPT-2), the
Llama-shaped ones through the lean fused forward, the others through their modules with the paged
attention; sliding-window and hybrid-attention ones (Gemma 2/3, Mistral v0.1, Phi-3 mini) are refused
with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from ead_llm import LargeOnly
from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair
from ead_llm.core.request import Request, SamplingParams
from ead_llm.core.types import Role
from ead_llm.testing.tiny import char_tokenizer

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
RUNS: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    # family: (config class, model class, extra config, fused lean forward)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2, "use_sliding_window": False}, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}, False),
    "mistral-v0.3": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": None}, True),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"num_key_value_heads": 4, "sliding_window": None, "pad_token_id": 0},
        False,
    ),
    "phi3-long-window": (  # Phi-3 mini 128k: a window longer than the context never slides
        "Phi3Config",
        "Phi3ForCausalLM",
        {"num_key_value_heads": 4, "sliding_window": 512, "pad_token_id": 0},
        False,
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_layer": 2, "n_head": 4}, False),
}
REFUSED: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}, "sliding_attention"),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"num_key_value_heads": 2, "head_dim": 16},
        "sliding_attention",
    ),
    "mistral-v0.1": (
        "MistralConfig",
        "MistralForCausalLM",
        {"num_key_value_heads": 2, "sliding_window": 64},
        "sliding-window",
    ),
    "phi3-mini": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"num_key_value_heads": 4, "sliding_window": 64, "pad_token_id": 0},
        "sliding-window",
    ),
}


def _build(folder: Path, config_name: str, model_name: str, extra: dict[str, Any], seed: int) -> str:
    tokenizer = char_tokenizer()
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config_class = getattr(transformers, config_name)
    settings = {**SHAPE, "vocab_size": len(tokenizer), "max_position_embeddings": 256, **ids, **extra}
    if config_name == "GPT2Config":
        settings = {k: v for k, v in settings.items() if k not in SHAPE} | {"n_positions": 256}
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config_class(**settings)).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("family", sorted(RUNS))
def test_a_full_attention_family_runs_and_matches_its_generate(family: str, tmp_path: Path) -> None:
    config_name, model_name, extra, fused = RUNS[family]
    small = _build(tmp_path / "small", config_name, model_name, extra, seed=1)
    large = _build(tmp_path / "large", config_name, model_name, extra, seed=2)
    engine = Engine(load_pair(LoadConfig(small=small, large=large, device="cpu")))
    assert (engine.runners[Role.LARGE]._fused is not None) is fused
    prompt = engine.encode("12+35=")
    (done,) = engine.generate([Request(prompt, LargeOnly(), SamplingParams(max_tokens=12, ignore_eos=True))])
    reference = getattr(transformers, model_name).from_pretrained(large).eval()
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert list(done.token_ids) == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_windowed_and_hybrid_families_are_refused_with_the_reason(family: str, tmp_path: Path) -> None:
    config_name, model_name, extra, reason = REFUSED[family]
    small = _build(tmp_path / "small", config_name, model_name, extra, seed=1)
    with pytest.raises(ValueError, match=reason):
        Engine(load_pair(LoadConfig(small=small, large=small, device="cpu")))
