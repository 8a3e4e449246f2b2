"""One engine per loaded pair, shared by every object and thread that asks for the same pair."""

from __future__ import annotations

import threading
from pathlib import Path

from ead_llm.core.engine import Engine
from ead_llm.core.loading import LoadConfig, load_pair

_ENGINES: dict[LoadConfig, Engine] = {}
_LOCK = threading.Lock()


def _canonical(config: LoadConfig) -> LoadConfig:
    """Same key for a folder however it is spelled."""
    fields = {}
    for name in ("small", "large"):
        source = getattr(config, name)
        path = Path(source).expanduser()
        fields[name] = str(path.resolve()) if path.exists() else source
    device, dtype = str(config.resolved_device()), str(config.resolved_dtype()).removeprefix("torch.")
    return config.model_copy(update={**fields, "device": device, "dtype": dtype})


def shared_engine(config: LoadConfig) -> Engine:
    """The engine for ``config``, loading the pair on first use."""
    key = _canonical(config)
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = Engine(load_pair(key))
            engine.load_config = key
            _ENGINES[key] = engine
        return engine


def clear_engines() -> None:
    """Forget every shared engine (their models are freed once no object holds them)."""
    with _LOCK:
        _ENGINES.clear()
