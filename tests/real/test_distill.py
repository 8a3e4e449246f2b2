"""The draft distillation script, run for two steps on two questions: it trains the early-exit layers
and norm (embeddings frozen), and writes a loadable draft with its card."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ead_llm.testing import distill, smollm2

pytestmark = pytest.mark.real_model


@pytest.mark.slow  # 20-35 s; tests/drafts covers ead-llm distill in the README's suite
def test_two_steps_write_a_trained_draft_with_its_card(real_paths: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "draft"
    card = distill.main(["--questions", "3", "--steps", "2", "--batch", "2", "--threads", "1", "--out", str(out)])
    assert card["steps"] == 2 and card["budget"] == "2 steps" and card["held_out_answers"] >= 1
    assert 0.0 <= card["top1_agreement_before"] <= 1.0 and 0.0 <= card["top1_agreement_after"] <= 1.0
    assert (out / "draft_card.json").is_file() and "top1_agreement_after" in (out / "README.md").read_text()
    trained = AutoModelForCausalLM.from_pretrained(out)
    untrained = AutoModelForCausalLM.from_pretrained(real_paths[0])
    assert trained.config.num_hidden_layers == smollm2.DRAFT_LAYERS
    weights, before = trained.state_dict(), untrained.state_dict()
    assert not torch.equal(
        weights["model.layers.0.mlp.down_proj.weight"], before["model.layers.0.mlp.down_proj.weight"]
    )
    assert torch.equal(weights["model.embed_tokens.weight"], before["model.embed_tokens.weight"])  # frozen


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        distill.main(["--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
