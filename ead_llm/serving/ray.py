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

Failure contract: when a replica dies, Ray Serve replaces it; requests it held fail (HTTP 500 or a
dropped connection) and are not retried by the server. A client retries them; with a ``seed`` (the
default 0) a retried request gives the same text, so a retry is safe. New requests go to live replicas.

Needs ``pip install 'ead-llm[ray]'``.
"""

from __future__ import annotations

from typing import Any

from ead_llm.core.validation import check_int

REPLICA_HEADER = "x-ead-replica"


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
    import ray

    serve = _ray()
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(app, name="ead-llm", route_prefix="/")
    if not blocking:
        return handle
    try:
        import time

        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return handle
