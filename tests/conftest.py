"""Shared fixtures: tiny random pairs built from configs, saved to disk and loaded by path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one torch thread each, for the
    os.environ["OMP_NUM_THREADS"] = "1"  # subprocesses the tests start too (threads spinning on one core slow 10x)

import pytest
import torch

from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, ModelPair, load_pair
from ead_llm.core.model_runner import ModelRunner, PackedBatch
from ead_llm.testing.tiny import build_tiny_pair, byte_bpe_tokenizer
from tests.tiny_pairs import BPE_CORPUS

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM: no network fetch in tests
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_tiny_pair(tmp_path_factory.mktemp("llama"), family="llama", seed=0)


@pytest.fixture(scope="session")
def gpt2_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tokenizer = byte_bpe_tokenizer(BPE_CORPUS, vocab_size=320)
    return build_tiny_pair(tmp_path_factory.mktemp("gpt2"), family="gpt2", tokenizer=tokenizer, seed=3)


@pytest.fixture(scope="session")
def llama_pair(llama_paths: tuple[Path, Path]) -> ModelPair:
    return load_pair(LoadConfig(small=str(llama_paths[0]), large=str(llama_paths[1]), device="cpu"))


@pytest.fixture(scope="session")
def gpt2_pair(gpt2_paths: tuple[Path, Path]) -> ModelPair:
    return load_pair(LoadConfig(small=str(gpt2_paths[0]), large=str(gpt2_paths[1]), device="cpu"))


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def pair(request: pytest.FixtureRequest) -> ModelPair:
    return request.getfixturevalue(f"{request.param}_pair")


@pytest.fixture(scope="session")
def engine(pair: ModelPair) -> Engine:
    return Engine(pair)


@pytest.fixture
def packed(monkeypatch: pytest.MonkeyPatch) -> list[PackedBatch]:
    """Every packed batch the runners build during the test (what each query attends to), in order."""
    batches: list[PackedBatch] = []
    original = ModelRunner._pack

    def pack(self: ModelRunner, rows: Any) -> Any:
        out = original(self, rows)
        batches.append(out[0])
        return out

    monkeypatch.setattr(ModelRunner, "_pack", pack)
    return batches
