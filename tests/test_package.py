"""The package's shape: every public name, lazy imports, and a core free of the frameworks."""

from __future__ import annotations

import subprocess
import sys

import ead_llm

FRAMEWORKS = {"dspy", "langchain_core", "litellm"}


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_core_and_the_policies_import_no_framework() -> None:
    assert _loaded_after("import ead_llm.core, ead_llm.policies.eager, ead_llm.accounting.ledger") & FRAMEWORKS == set()
    assert _loaded_after("import ead_llm") & (FRAMEWORKS | {"torch", "transformers"}) == set()  # lazy
    assert "langchain_core" in _loaded_after("from ead_llm import EntropyAdaptiveLLM")


def test_every_public_name_resolves() -> None:
    api = {"EntropyAdaptiveLLM", "EAD", "EASD", "EAGER", "SpeculativeDecoding", "SmallOnly", "LargeOnly"}
    assert api | {"ChatEntropyAdaptive", "Engine", "Request", "SamplingParams", "track_cost"} <= set(ead_llm.__all__)
    for name in ead_llm.__all__:
        assert getattr(ead_llm, name) is not None and name in dir(ead_llm)
