"""A FastAPI app served by uvicorn on a free loopback port, for tests that speak real HTTP to it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


def serve(app: Any) -> Iterator[str]:
    """Run ``app`` on 127.0.0.1 (a free port) in a thread; yield its base URL, then stop it."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
