"""The default pair shipped inside the package (small/ and large/ folders beside this file)."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent


def embedded_pair() -> tuple[str, str]:
    """Folders of the embedded small and large models; a clear error if they are not shipped."""
    small, large = EMBEDDED_DIR / "small", EMBEDDED_DIR / "large"
    if not (small / "config.json").exists() or not (large / "config.json").exists():
        raise FileNotFoundError(
            "this build of ead-llm ships no embedded default pair yet: pass small= and large= "
            "(Hugging Face ids or local folders), or build a tiny random pair with "
            "ead_llm.tiny.build_tiny_pair(folder)"
        )
    return str(small), str(large)
