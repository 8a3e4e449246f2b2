"""The default pair shipped inside the package (small/ and large/ folders beside this file).

``pair.json`` beside them records the EAD settings chosen on the task's dev split and the
measured test accuracies (written by ``python -m ead_llm.embedded.finalize``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ead_llm.policies.switching import EAD

EMBEDDED_DIR = Path(__file__).resolve().parent


def embedded_pair() -> tuple[str, str]:
    """Folders of the embedded small and large models; a clear error if they are not shipped."""
    small, large = EMBEDDED_DIR / "small", EMBEDDED_DIR / "large"
    if not (small / "config.json").exists() or not (large / "config.json").exists():
        raise FileNotFoundError(
            "this install of ead-llm has no embedded default pair (ead_llm/embedded/small and large): "
            "pass small= and large= (Hugging Face ids or local folders)"
        )
    return str(small), str(large)


def pair_record() -> dict[str, Any]:
    """The embedded pair's evaluation record (empty if it has not been written)."""
    path = EMBEDDED_DIR / "pair.json"
    return json.loads(path.read_text()) if path.exists() else {}


def recommended_threshold(default: float = 0.25) -> float:
    """EAD threshold (bits) chosen for the embedded pair on its dev split."""
    return float(pair_record().get("recommended_threshold", default))


def recommended_policy() -> EAD:
    """The EAD settings chosen for the embedded pair on its dev split (threshold, window, dwell, lookahead): what
    ``EntropyAdaptiveLLM()`` and ``ead-llm demo`` run. EAD as published at ``recommended_threshold()`` when the
    record names none."""
    from ead_llm.policies.switching import EAD

    settings = pair_record().get("recommended_policy")
    return EAD(**settings) if settings else EAD(threshold=recommended_threshold())
