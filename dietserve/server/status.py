"""The error -> status mapping of both wires, and the gRPC interceptor every RPC passes: the API
key check, the concurrency cap and the count of RPCs by method and status code (health and
reflection included).

Handlers raise the transport-free errors of ``runtime/errors.py``; this module alone turns them
into gRPC statuses (:func:`status_of`) and HTTP statuses (:func:`http_status_of`). Anything else
is a bug: logged with its traceback, answered INTERNAL (HTTP 500) with a reference the operator
can find in the log, never with the traceback itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid

import grpc

from ..runtime.errors import (
    Expired,
    InputError,
    InputTooLong,
    NotReady,
    Overloaded,
    ReplyTooLarge,
    RequestIncomplete,
    RequestTooLarge,
    ServingError,
    Unauthenticated,
    UnknownModel,
)
from .auth import AUTHORIZATION, ApiKeys
from .inference import ConcurrencyCap
from .metrics import ServerMetrics

log = logging.getLogger("dietserve.server")

STATUS_OF_ERROR: dict[type[ServingError], grpc.StatusCode] = {
    InputError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownModel: grpc.StatusCode.NOT_FOUND,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ReplyTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Expired: grpc.StatusCode.DEADLINE_EXCEEDED,
    RequestTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}
# The first entry that matches wins: subclasses before their bases.
HTTP_STATUS_OF_ERROR: dict[type[ServingError], int] = {
    InputTooLong: 413,  # the request's content is larger than the model takes
    RequestTooLarge: 413,
    RequestIncomplete: 408,
    InputError: 400,
    UnknownModel: 404,
    NotReady: 503,
    Overloaded: 429,  # retrying later can succeed
    ReplyTooLarge: 400,  # ask for fewer rows or outputs: the request as sent will never be answered
    Expired: 504,
    Unauthenticated: 401,
}
INTERNAL_HTTP_STATUS = 500
UNKNOWN_METHOD = "unknown"
# Probes must answer however busy the server is: they are never refused by the cap.
UNCAPPED_SERVICES = ("/grpc.health.v1.Health/",)
# Liveness and readiness answer without an API key: probes and load balancers hold none.
KEYLESS_METHODS = ("/grpc.health.v1.Health/", "/inference.GRPCInferenceService/ServerLive",
                   "/inference.GRPCInferenceService/ServerReady")


def status_of(err: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a client gets for ``err``."""
    for error_type, code in STATUS_OF_ERROR.items():
        if isinstance(err, error_type):
            return code, str(err)
    return grpc.StatusCode.INTERNAL, _unexpected(err)


def http_status_of(err: Exception) -> tuple[int, str]:
    """The HTTP status and message a client gets for ``err``."""
    for error_type, status in HTTP_STATUS_OF_ERROR.items():
        if isinstance(err, error_type):
            return status, str(err)
    return INTERNAL_HTTP_STATUS, _unexpected(err)


def _unexpected(err: Exception) -> str:
    reference = uuid.uuid4().hex[:12]
    log.error("unexpected error (reference %s)", reference, exc_info=err)
    return f"internal error (reference {reference} in the server log)"


class ServingInterceptor(grpc.aio.ServerInterceptor):
    """``cap``: calls handled at once, shared with HTTP (health checks aside); more are refused
    with RESOURCE_EXHAUSTED before their message is read. ``api_keys``: calls without one of
    them (``authorization`` metadata ``Bearer KEY``) are refused with UNAUTHENTICATED, before the
    cap counts them; health and readiness aside."""

    def __init__(self, metrics: ServerMetrics, cap: ConcurrencyCap, api_keys: ApiKeys | None = None):
        self.metrics = metrics
        self.cap = cap
        self.api_keys = api_keys
        self._refused = metrics.unauthenticated.labels("grpc")
        self._counters: dict[tuple[str, str], object] = {}  # labels() costs microseconds per call
        self._wrapped: dict[str, tuple[object, object]] = {}  # method -> (its handler, wrapped)

    def count(self, method: str, code: grpc.StatusCode) -> None:
        counter = self._counters.get((method, code.name))
        if counter is None:
            counter = self._counters[(method, code.name)] = self.metrics.requests.labels(method, code.name)
        counter.inc()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        full_method = handler_call_details.method
        method = full_method.rsplit("/", 1)[-1]
        if handler is None:  # gRPC answers UNIMPLEMENTED
            # One label for every unknown name: a client must not be able to mint label values.
            self.count(UNKNOWN_METHOD, grpc.StatusCode.UNIMPLEMENTED)
            return None
        cached = self._wrapped.get(full_method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        keyed = self.api_keys is not None and not full_method.startswith(KEYLESS_METHODS)
        wrapped = self._wrapped_handler(handler, method, not full_method.startswith(UNCAPPED_SERVICES), keyed)
        self._wrapped[full_method] = (handler, wrapped)
        return wrapped

    def _wrapped_handler(self, handler, method: str, capped: bool, keyed: bool):
        for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                           ("unary_stream", grpc.unary_stream_rpc_method_handler),
                           ("stream_unary", grpc.stream_unary_rpc_method_handler),
                           ("stream_stream", grpc.stream_stream_rpc_method_handler)):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(self._wrap(behavior, method, capped, keyed),
                            request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler

    def _wrap(self, behavior, method: str, capped: bool, keyed: bool):
        if inspect.isasyncgenfunction(behavior):
            async def streaming(request, context):
                async with self._track(method, context, capped, keyed):
                    async for response in behavior(request, context):
                        yield response
            return streaming

        async def handle(request, context):
            async with self._track(method, context, capped, keyed):
                return await behavior(request, context)
        return handle

    async def _authenticate(self, method: str, context: grpc.aio.ServicerContext) -> None:
        presented = next((value for key, value in context.invocation_metadata() or () if key == AUTHORIZATION), None)
        try:
            self.api_keys.check(presented)
        except Unauthenticated as err:
            self._refused.inc()
            self.count(method, grpc.StatusCode.UNAUTHENTICATED)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(err))

    @contextlib.asynccontextmanager
    async def _track(self, method: str, context: grpc.aio.ServicerContext, capped: bool, keyed: bool):
        if keyed:
            await self._authenticate(method, context)
        refusal = self.cap.refusal() if capped else None
        if refusal is not None:
            self.count(method, grpc.StatusCode.RESOURCE_EXHAUSTED)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        self.cap.active += capped
        code = None
        try:
            yield
        except grpc.aio.AbortError:
            code = context.code()
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as err:  # noqa: BLE001 - every failure becomes a status here
            code, message = status_of(err)
            await context.abort(code, message)
        finally:
            self.cap.active -= capped
            self.count(method, code or context.code() or grpc.StatusCode.OK)
