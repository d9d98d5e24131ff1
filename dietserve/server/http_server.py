"""The HTTP port: KServe v2 REST (``http_v2.py``), OpenAI embeddings and ``/health``
(``openai_api.py``), rerank and classification (``rerank_api.py``), TEI's embedding routes
(``tei_api.py``), in an aiohttp application on
the gRPC server's event loop, over the same ``inference.Inference`` core: same models, batcher,
limits and metrics.

One middleware wraps every request: the API key check (``--api-key-file``; probes exempt), the
concurrency cap shared with gRPC (probes exempt), the error -> status mapping
(``status.http_status_of``) with each API's error body, and the count of requests by route and
status (``dietserve_http_requests_total``).
"""

from __future__ import annotations

import asyncio
import ssl

from aiohttp import web

from ..runtime.errors import Overloaded, Unauthenticated
from . import openai_api, tei_api
from .auth import AUTHORIZATION, CHALLENGE
from .config import ServerConfig
from .http_body import json_response
from .http_v2 import V2Routes
from .inference import Inference
from .openai_api import OpenAIRoutes
from .rerank_api import RerankRoutes
from .status import http_status_of
from .tei_api import TeiRoutes

# Never refused by the cap, and answered without an API key: probes hold none.
PROBE_ROUTES = frozenset({"/health", "/ping", "/v2/health/live", "/v2/health/ready"})
# The routes that run the model, whose answers the server reports when it stops.
INFERENCE_ROUTES = frozenset({"/v1/embeddings", "/rerank", "/v1/rerank", "/predict", "/", "/invocations", "/embed",
                              "/embed_sparse", "/embed_all", "/similarity"})
UNKNOWN_ROUTE = "unknown"  # one label for every path no route matches: clients cannot mint label values
CLIENT_CLOSED = 499  # counted for a request whose client went away (nginx's convention; never sent)
CLOSE_IDLE_SECONDS = 1.0  # after the grace period: how long aiohttp may take to close connections


def is_inference_route(route: str) -> bool:
    """Whether ``route`` (a canonical path, as counted) runs the model: v2 infer, embeddings, rerank."""
    return route in INFERENCE_ROUTES or route.endswith("/infer")


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNKNOWN_ROUTE


def _explain(request: web.Request, err: web.HTTPException) -> str:
    """aiohttp's own refusals (no route, wrong method), said in a sentence that names the problem."""
    if isinstance(err, web.HTTPMethodNotAllowed):
        return f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(err.allowed_methods))}"
    if isinstance(err, web.HTTPNotFound):
        return (f"no route {request.method} {request.path}: this server answers /v2/... (KServe v2), "
                "/v1/embeddings and /v1/models (OpenAI), /embed, /embed_sparse, /embed_all, /similarity, /rerank, "
                "/predict, /tokenize, /decode and /info (TEI), /v1/rerank (Cohere) and /health")
    return err.text or err.reason


def error_response(request: web.Request, status: int, message: str, err: Exception | None) -> web.Response:
    """OpenAI's error shape under /v1/, TEI's on its routes, the v2 protocol's elsewhere; a 401
    says the scheme."""
    if request.path.startswith("/v1/"):
        response = json_response(openai_api.error_body(status, message, err), status)
    elif _route(request) in tei_api.TEI_ROUTES:
        response = json_response(tei_api.error_body(status, message), status)
    else:
        response = json_response({"error": message}, status)
    if isinstance(err, Unauthenticated):
        response.headers.update(CHALLENGE)
    return response


def ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The gRPC port's TLS settings, for HTTPS on the HTTP port."""
    if not config.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca is not None:
        context.load_verify_locations(config.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class HttpServer:
    def __init__(self, core: Inference):
        self.core = core
        self.metrics = core.state.metrics
        app = web.Application(client_max_size=core.state.config.max_request_bytes, middlewares=[self._serve])
        V2Routes(core).add_to(app)
        OpenAIRoutes(core).add_to(app)
        rerank = RerankRoutes(core)
        rerank.add_to(app)
        TeiRoutes(core, rerank.rerank, rerank.predict).add_to(app)
        # handler_cancellation: a request whose client has gone leaves the batcher's queue, as over gRPC.
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=CLOSE_IDLE_SECONDS)
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._counters: dict[tuple[str, int], object] = {}  # labels() costs microseconds per call
        self._refused = self.metrics.unauthenticated.labels("http")

    async def start(self, host: str, port: int) -> int:
        """Listens on ``host:port`` (0: any free port); returns the bound port."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context(self.core.state.config))
        await site.start()
        return self._runner.addresses[0][1]

    async def finish(self, grace: float) -> None:
        """Stops accepting connections, gives requests in flight ``grace`` seconds, closes."""
        for site in list(self._runner.sites):
            await site.stop()
        if self._runner.server is not None:
            self._runner.server.pre_shutdown()  # keep-alive connections close after their current request
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            pass
        await self._runner.cleanup()

    def _count(self, route: str, status: int) -> None:
        counter = self._counters.get((route, status))
        if counter is None:
            counter = self._counters[(route, status)] = self.metrics.http_requests.labels(route, str(status))
        counter.inc()

    def _authenticate(self, request: web.Request) -> None:
        keys = self.core.state.api_keys
        if keys is None:
            return
        try:
            keys.check(request.headers.get(AUTHORIZATION))
        except Unauthenticated:
            self._refused.inc()
            raise

    @web.middleware
    async def _serve(self, request: web.Request, handler) -> web.StreamResponse:
        route, status = _route(request), CLIENT_CLOSED
        cap = self.core.state.cap
        capped = route not in PROBE_ROUTES
        self._active += 1
        self._idle.clear()
        try:
            if capped:
                self._authenticate(request)
            refusal = cap.refusal() if capped else None
            if refusal is not None:
                raise Overloaded(refusal)
            cap.active += capped
            try:
                response = await handler(request)
            finally:
                cap.active -= capped
            status = response.status
            return response
        except web.HTTPException as err:
            status = err.status
            return error_response(request, status, _explain(request, err), None)
        except Exception as err:  # noqa: BLE001 - every failure becomes a status here
            status, message = http_status_of(err)
            return error_response(request, status, message, err)
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()
            self._count(route, status)
