"""Where a model comes from: a local folder, a ``.gguf`` file, or a Hugging Face Hub id (checks without torch)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

GGUF_SUFFIX = ".gguf"
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
RESOLVE_TIMEOUT_S = 3.0


def cache_dir() -> Path:
    """ead-llm's own cache on this machine (converted models, kernels chosen): ``$EAD_LLM_CACHE`` or
    ``~/.cache/ead-llm``."""
    return Path(os.environ.get("EAD_LLM_CACHE", Path.home() / ".cache" / "ead-llm"))


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold ``name`` in :func:`cache_dir` as an exclusive lock across processes (parallel test workers, jobs, an
    engine per process) until the block ends. Not re-entrant. Where there is no ``fcntl`` (not POSIX) or the folder
    cannot be made, nothing is locked and the block runs as it is."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        handle = (cache_dir() / name).open("w")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def model_source(name: str, value: Any) -> str:
    """A model's Hugging Face id or local folder as text (a ``pathlib.Path`` or other path-like is taken, as
    ``from_pretrained`` takes it); a clear error for anything else."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a Hugging Face model id or a local folder, got {value!r}")
    return value


def is_local(source: str) -> bool:
    """Whether ``source`` names something on this machine (a folder or a file)."""
    return Path(source).expanduser().exists()


def check_source(name: str, source: str) -> None:
    """Refuse a local-looking path that does not exist (a Hub id has at most one slash; a GGUF file on
    the Hub is ``org/repo/file.gguf``)."""
    if is_local(source):
        return
    if source.endswith(GGUF_SUFFIX) and not source.startswith((".", "/", "~")) and source.count("/") == 2:
        return
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ValueError(f"{name} model folder {source!r} does not exist")


def hub_unreachable(timeout_s: float = RESOLVE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (its host name does not resolve), or None when it
    may be. Behind a proxy the proxy resolves names, so nothing is checked; a lookup slower than ``timeout_s``
    counts as reachable (the download's own errors then say what is wrong)."""
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    host = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    failure: list[str] = []

    def resolve() -> None:
        try:
            socket.getaddrinfo(host, 443)
        except OSError as err:
            failure.append(f"{host} does not resolve: {err}")

    lookup = threading.Thread(target=resolve, daemon=True)
    lookup.start()
    lookup.join(timeout_s)
    return failure[0] if failure else None
