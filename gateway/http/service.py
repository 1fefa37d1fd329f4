"""The routes that ask about the service, not about a request: ``GET /metrics``, ``/v1/models``,
``/v1/models/{id}``, ``/healthz`` and ``/readyz`` (docs/http-api.md, docs/operations.md).

They read the :class:`~gateway.http.app.Gateway`'s state and the core's snapshots; none of them
queues work. ``/v1/models`` answers in the shape of the API the client speaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from batcher.core.backend import Snapshot
from batcher.core.counters import Counters
from gateway.wire import anthropic, api, openai
from gateway.wire.errors import speaks_anthropic

if TYPE_CHECKING:  # the app imports this module to register its routes
    from gateway.http.app import Gateway


class Service:
    """The service routes' handlers over one :class:`Gateway`."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def metrics_text(self, request: web.Request) -> web.Response:
        """Prometheus text format: every ferry_* family (docs/admission.md, "Metrics")."""
        body = self.gateway.metrics.exposition(await self._snapshots())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """The versions that take traffic, then the aliases, in the shape the client speaks."""
        gateway = self.gateway
        gateway.keys.authenticate(request.headers)
        served = gateway.catalog.windows()
        if speaks_anthropic(request):
            return _json(anthropic.models_body(served, gateway.created_at))
        return _json(openai.models_body(served, gateway.created))

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one version or alias (the SDKs' ``models.retrieve``); 404 if
        it is not served."""
        gateway = self.gateway
        gateway.keys.authenticate(request.headers)
        name = request.match_info["model_id"]
        window = gateway.catalog.window(name)
        if speaks_anthropic(request):
            return _json(anthropic.model_info(name, gateway.created_at, window))
        return _json(openai.model_info(name, gateway.created, window))

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive: this process answers, and its trio core still runs."""
        if not self.gateway.bridge.running:
            return _json(api.error_body(api.INTERNAL, "the scheduling core has stopped"), 503)
        return web.json_response({"status": "ok"})  # the bytes it always had: spaced

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready: every model's backend says so (fixed mode: a worker up and not hung, and a call
        answered since every slot last lost its worker). The body details each model's status,
        and says why a model that is not ready is not."""
        snapshots = await self._snapshots()
        models = {name: snapshot.status.body() for name, snapshot in snapshots.items()}
        waiting = [f"{name}: {snap.status.reason}" for name, snap in snapshots.items() if not snap.ready]
        if models and not waiting:
            return _json({"ready": True, "models": models})
        why = "; ".join(waiting) if waiting else "the scheduling core is not running"
        body = {**api.error_body(api.INTERNAL, f"not ready: {why}"), "ready": False, "models": models}
        return _json(body, 503)

    async def _snapshots(self) -> dict[str, Snapshot[Counters]]:
        bridge = self.gateway.bridge
        return await bridge.snapshots() if bridge.running else {}


def _json(value: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=api.dumps(value), content_type="application/json")


def add_routes(app: web.Application, gateway: Gateway) -> None:
    """The service routes (no key for health and metrics; the models routes take one)."""
    routes = Service(gateway)
    app.router.add_get("/metrics", routes.metrics_text)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model_id}", routes.model)
    app.router.add_get("/healthz", routes.healthz)
    app.router.add_get("/readyz", routes.readyz)
