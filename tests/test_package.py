"""The package's shape: every public name, lazy imports, and a core free of the frameworks."""

from __future__ import annotations

import re
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


def test_the_core_never_imports_the_policies() -> None:
    """``core/`` holds the contract (``core/policy.py``, ``core/types.py``); the families build on it and register
    themselves, so no module of the core imports ``ead_llm.policies``, whichever is loaded."""
    import pathlib

    core = pathlib.Path(ead_llm.__file__).parent / "core"
    modules = sorted(f"ead_llm.core.{p.stem}" for p in core.glob("*.py") if p.stem != "__init__")
    code = (
        f"import sys\nimport {', '.join(modules)}\nprint([m for m in sys.modules if m.startswith('ead_llm.policies')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    written = re.compile(r"^\s*(from|import) ead_llm\.policies", re.MULTILINE)  # lazy imports included
    assert [p.name for p in core.glob("*.py") if written.search(p.read_text())] == []
