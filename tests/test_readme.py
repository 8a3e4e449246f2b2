"""The README's copy-paste blocks work when pasted whole: each Python and shell block runs as it stands (the
server's on a free port), and prints what its comments promise. A block that cannot run here says why, in a
comment just above it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = "<!-- not run by the README test:"
EXPECTED = {
    'ead-llm generate "4821+3907-1568"': ["#### 7160"],
    'llm.invoke("4821+3907-1568\\n")': ["#### 7160", "'#### 5913', '#### 5555'"],
    'dspy.Predict("problem -> answer: int")': ["7160"],
    "ead-llm serve --port 8000": ['"text":', "#### 7160", '"large_fraction"'],
    "PolicyOptimizer(share_right": ["metric: LargeOnly", "  easy: ", "  hard: ", "search: "],
}
"""What each runnable block must print, keyed by a line it holds: a new block needs an entry."""


def blocks() -> list[tuple[str, str, str | None]]:
    """``(language, code, why it is not run)`` of every fenced python or bash block."""
    found = []
    for match in re.finditer(r"(?:(<!--[^\n]*-->)\n)?```(python|bash)\n(.*?)```", README.read_text(), re.S):
        note, language, code = match.groups()
        found.append((language, code, note[len(SKIP) :].strip(" ->") if note and note.startswith(SKIP) else None))
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_every_block_is_run_or_says_why_not() -> None:
    runnable = [code for _, code, why in blocks() if why is None]
    assert len(runnable) == len(EXPECTED)
    for code in runnable:
        assert sum(key in code for key in EXPECTED) == 1, f"no expectation (or two) for this block:\n{code}"
    assert all(why for _, _, why in blocks() if why is not None)


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_readme_block_runs_when_pasted_whole(key: str, tmp_path: Path) -> None:
    language, code = next((lang, code) for lang, code, why in blocks() if why is None and key in code)
    if "8000" in code:
        code = code.replace("8000", str(free_port()))  # the block as written, on a port nobody else holds
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DSPY_CACHEDIR": str(tmp_path / "dspy"), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-c", code] if language == "python" else ["bash", "-c", code]
    bin_dir = str(Path(sys.executable).parent)  # where pip put the ead-llm script
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for needle in EXPECTED[key]:
        assert needle in done.stdout, f"{needle!r} not in the output of the block:\n{done.stdout[-3000:]}"
