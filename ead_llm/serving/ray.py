"""``ead-llm serve --replicas N``: the OpenAI-compatible app on Ray Serve, one engine per replica.

Each replica builds the same FastAPI app as the plain server (:func:`ead_llm.serving.server.create_app`)
around its own :class:`~ead_llm.adapters.langchain_llm.EntropyAdaptiveLLM` (Ray Serve's ``@serve.ingress``
with the app built on the replica), so every endpoint, the bill in ``usage``, streaming, per-request
policies and seeds behave exactly as on one server; a seeded greedy request gives the same text on any
replica (each loads the same weights and decodes deterministically). Every response names its replica
in an ``x-ead-replica`` header.

Routing: Ray Serve's default request router, power of two choices on each replica's queue length
(requests ongoing there). It is used as is because a replica's queue is its engine's load: an HTTP
request is one sequence (``n`` > 1: n), running or waiting in that replica's continuous batch, so the
shorter queue is the replica with the fewest running plus waiting sequences; a custom router would
only re-derive that number. ``max_ongoing_requests`` (default: the engine's ``max_batch``) caps what
a replica accepts, so a full replica sends the next request elsewhere instead of queueing it.

Failure contract: when a replica dies, Ray Serve replaces it; a request it held that had not started
its answer gets HTTP 503 with ``Retry-After: 1`` and an OpenAI-style error (a stream already under way
is cut), and is not retried by the server. Clients retry 503s (OpenAI's and LangChain's do); with a
``seed`` (the default 0) a retried request gives the same text, so a retry is safe. New requests go to
live replicas. The 503 comes from :func:`proxy_middlewares`, installed in Serve's HTTP proxy through its
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` hook (Serve itself answers 500 when a replica dies): ``run``
sets it for a local cluster; a cluster started elsewhere needs it in its environment
(``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=ead_llm.serving.ray:proxy_middlewares ray start --head``).

``run`` stops on SIGTERM as on Ctrl-C (Serve and Ray shut down, exit status 0).

Needs ``pip install 'ead-llm[ray]'``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ead_llm.core.validation import check_int
from ead_llm.serving.errors import error_body

logger = logging.getLogger(__name__)
REPLICA_HEADER = "x-ead-replica"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "ead_llm.serving.ray:proxy_middlewares"
RETRY_AFTER_S = 1
PATIENT_PROXY = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
"""Serve's defaults (5 s for the proxy to start, 10 s per health check, else it is killed) lost the proxy on a
busy 2-core machine (CI: ``ActorDiedError ... killed by ray.kill`` at setup); a local cluster gets these unless
they are set."""


def local_cluster_environment() -> None:
    """The environment a local cluster started from here inherits: the proxy's middleware, a patient proxy."""
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    for name, value in PATIENT_PROXY.items():
        os.environ.setdefault(name, value)


class NoReplicaAnswered:
    """ASGI middleware for Serve's HTTP proxy: a request no replica answered (its replica died, or none is up) gets
    503 with ``Retry-After`` and an OpenAI-style error instead of Serve's bare 500. A replica's own answers (they
    carry :data:`REPLICA_HEADER`) pass unchanged, errors included."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "replaced": False}

        async def guarded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = {bytes(k).lower() for k, _ in message.get("headers", [])}
                if message["status"] >= 500 and REPLICA_HEADER.encode() not in headers:
                    state["replaced"] = True
                    await self._unavailable(send)
                    return
                state["started"] = True
            elif state["replaced"]:
                return  # the proxy's own body of the replaced answer
            await send(message)

        try:
            await self.app(scope, receive, guarded)
        except Exception:
            if state["started"] or state["replaced"]:
                raise
            logger.warning("no replica answered %s; answering 503", scope.get("path"))
            await self._unavailable(send)
            return
        if not state["started"] and not state["replaced"]:
            await self._unavailable(send)

    @staticmethod
    async def _unavailable(send: Any) -> None:
        message = f"no replica could answer (one was lost or none is up): retry in {RETRY_AFTER_S} s"
        body = json.dumps(error_body(message, "server_error", code="replica_unavailable")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Any]:
    """Serve's HTTP proxy callback (its ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): :class:`NoReplicaAnswered`."""
    from starlette.middleware import Middleware

    return [Middleware(NoReplicaAnswered)]


def _ray() -> Any:
    try:
        from ray import serve
    except ImportError:
        raise ImportError("serving on Ray needs Ray Serve: pip install 'ead-llm[ray]'") from None
    return serve


def deployment(
    llm_config: dict[str, Any] | None = None,
    *,
    model_name: str | None = None,
    replicas: int = 1,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_ongoing_requests: float | None = None,
    max_ongoing_requests: int | None = None,
    limits: Any = None,
) -> Any:
    """A Ray Serve application of the OpenAI-compatible app: ``replicas`` copies (or autoscaling between
    ``min_replicas`` and ``max_replicas`` at ``target_ongoing_requests`` each), each an engine built from
    ``llm_config`` (``EntropyAdaptiveLLM``'s arguments: ``small``, ``large``, ``policy``, ``max_tokens``...)
    with ``num_cpus``/``num_gpus`` reserved, each within ``limits`` (a
    :class:`~ead_llm.serving.server.ServerLimits`). Run it with ``serve.run(app)``."""
    serve = _ray()
    config = dict(llm_config or {})
    check_int("replicas", replicas, minimum=1)
    autoscaling: dict[str, Any] | None = None
    if min_replicas is not None or max_replicas is not None:
        low = check_int("min_replicas", 1 if min_replicas is None else min_replicas, minimum=0)
        high = check_int("max_replicas", replicas if max_replicas is None else max_replicas, minimum=max(low, 1))
        autoscaling = {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1)}
        # Serve's default target (2 ongoing requests per replica) would scale out a batching engine long
        # before it is busy: aim at half of what a replica accepts
        limit = max_ongoing_requests or int(config.get("max_batch") or 64)
        target = target_ongoing_requests if target_ongoing_requests is not None else max(1.0, limit / 2)
        autoscaling["target_ongoing_requests"] = float(target)
    actor: dict[str, Any] = {}
    if num_cpus is not None:
        actor["num_cpus"] = num_cpus
    if num_gpus is not None:
        actor["num_gpus"] = num_gpus
    options: dict[str, Any] = {
        "name": "ead-llm",
        "ray_actor_options": actor,
        "max_ongoing_requests": max_ongoing_requests or int(config.get("max_batch") or 64),
    }
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas

    @serve.ingress()
    class Replica:
        """One engine and its OpenAI-compatible app."""

        def __init__(self, llm_config: dict[str, Any], model_name: str | None, limits: Any) -> None:
            from ead_llm.adapters.langchain_llm import EntropyAdaptiveLLM

            self.llm = EntropyAdaptiveLLM(**llm_config)
            self.model_name = model_name
            self.limits = limits
            self.replica = serve.get_replica_context().replica_id.unique_id

        def __serve_build_asgi_app__(self) -> Any:
            from ead_llm.serving.server import create_app

            app = create_app(self.llm, self.model_name, self.limits)
            replica = self.replica

            @app.middleware("http")
            async def name_the_replica(request: Any, call_next: Any) -> Any:
                response = await call_next(request)
                response.headers[REPLICA_HEADER] = replica
                return response

            return app

        def check_health(self) -> None:
            """Ray Serve's health check: the engine's scheduler must not be wedged (its load readable)."""
            _ = self.llm.shared_engine.load

    return serve.deployment(Replica, **options).bind(config, model_name, limits)


def run(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    blocking: bool = True,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
) -> Any:
    """Start Ray (a local cluster unless ``RAY_ADDRESS`` names one), Serve's HTTP proxy on ``host:port``, and
    ``app``; with ``blocking``, until interrupted (then everything shuts down)."""
    import signal
    import threading

    import ray

    serve = _ray()
    if not ray.is_initialized():
        local_cluster_environment()
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    elif os.environ.get(PROXY_CALLBACK_ENV) != PROXY_CALLBACK:
        logger.warning(
            "Ray was started without %s=%s: a lost replica's requests get Serve's 500 instead of 503 + Retry-After",
            PROXY_CALLBACK_ENV,
            PROXY_CALLBACK,
        )
    if not blocking:
        serve.start(http_options={"host": host, "port": port})
        return serve.run(app, name="ead-llm", route_prefix="/")
    stop = threading.Event()

    def terminate(signum: int, frame: Any) -> None:  # Ray's own handler would abort the process
        if not stop.is_set():
            stop.set()
            raise KeyboardInterrupt  # out of a deployment still starting; a waiting loop just ends

    previous = signal.signal(signal.SIGTERM, terminate)
    handle = None
    try:
        serve.start(http_options={"host": host, "port": port})
        handle = serve.run(app, name="ead-llm", route_prefix="/")
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # shutting down: a second SIGTERM waits for it
        serve.shutdown()
        ray.shutdown()
        signal.signal(signal.SIGTERM, previous)
    return handle
