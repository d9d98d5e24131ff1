"""The GRPCInferenceService: v2 health, metadata and inference, plus Triton's extensions.

Every failure becomes a gRPC status whose message names the problem; unexpected errors are
logged here with their traceback and reach the client only as INTERNAL with a reference.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from .. import __version__
from ._proto import open_inference_pb2 as pb
from ._proto import open_inference_pb2_grpc as pb_grpc
from .batcher import DynamicBatcher, QueueFull
from .config import ServerConfig
from .metrics import ServerMetrics
from .model import ServedModel
from .requests import parse_request
from .tensors import RequestError, add_output

log = logging.getLogger("dietserve.server")

SERVER_NAME = "dietserve"
EXTENSIONS = ["model_configuration", "statistics", "parameters"]


@dataclass
class ServingState:
    """What the servicer serves; ``model`` and ``batcher`` are set once loading finishes."""

    config: ServerConfig
    metrics: ServerMetrics
    model_name: str
    model: ServedModel | None = None
    batcher: DynamicBatcher | None = None
    ready: bool = False


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServingState):
        self.state = state

    # ------------------------------------------------------------------ helpers

    def _model(self, name: str, version: str) -> ServedModel | None:
        """The model a request names, or a RequestError: NOT_FOUND, or UNAVAILABLE while loading."""
        if name != self.state.model_name:
            raise RequestError(f"unknown model '{name}'; this server serves '{self.state.model_name}'",
                               grpc.StatusCode.NOT_FOUND)
        if version not in ("", "1"):
            raise RequestError(f"model '{name}' has no version '{version}' (versions: 1)", grpc.StatusCode.NOT_FOUND)
        return self.state.model

    def _loaded(self, name: str, version: str) -> ServedModel:
        model = self._model(name, version)
        if model is None:
            raise RequestError(f"model '{name}' is still loading", grpc.StatusCode.UNAVAILABLE)
        return model

    async def _answer(self, method: str, context: grpc.aio.ServicerContext, build):
        """Runs ``build()``; turns RequestError into the status it names."""
        try:
            response = build()
        except RequestError as err:
            self.state.metrics.requests.labels(method, err.code.name).inc()
            await context.abort(err.code, str(err))
        self.state.metrics.requests.labels(method, "OK").inc()
        return response

    # ------------------------------------------------------------------ health and metadata

    async def ServerLive(self, request, context):
        return await self._answer("ServerLive", context, lambda: pb.ServerLiveResponse(live=True))

    async def ServerReady(self, request, context):
        return await self._answer("ServerReady", context, lambda: pb.ServerReadyResponse(ready=self.state.ready))

    async def ModelReady(self, request, context):
        def build():
            self._model(request.name, request.version)
            return pb.ModelReadyResponse(ready=self.state.ready)

        return await self._answer("ModelReady", context, build)

    async def ServerMetadata(self, request, context):
        return await self._answer("ServerMetadata", context, lambda: pb.ServerMetadataResponse(
            name=SERVER_NAME, version=__version__, extensions=EXTENSIONS))

    async def ModelMetadata(self, request, context):
        return await self._answer("ModelMetadata", context,
                                  lambda: self._loaded(request.name, request.version).metadata())

    async def ModelConfig(self, request, context):
        def build():
            model = self._loaded(request.name, request.version)
            config = self.state.config
            buckets = self.state.batcher.edges if self.state.batcher is not None else []
            return pb.ModelConfigResponse(config=model.config(config.batching, config.max_queue_delay_ms, buckets))

        return await self._answer("ModelConfig", context, build)

    async def ModelStatistics(self, request, context):
        def build():
            if request.name:
                models = [self._loaded(request.name, request.version)]
            else:
                models = [self.state.model] if self.state.model is not None else []
            return pb.ModelStatisticsResponse(model_stats=[model.statistics_proto() for model in models])

        return await self._answer("ModelStatistics", context, build)

    async def RepositoryIndex(self, request, context):
        def build():
            state = "READY" if self.state.ready else ("LOADING" if self.state.model is None else "UNAVAILABLE")
            if request.ready and state != "READY":
                return pb.RepositoryIndexResponse()
            entry = pb.RepositoryIndexResponse.ModelIndex(name=self.state.model_name, version="1", state=state)
            return pb.RepositoryIndexResponse(models=[entry])

        return await self._answer("RepositoryIndex", context, build)

    # ------------------------------------------------------------------ inference

    async def ModelInfer(self, request, context):
        metrics = self.state.metrics
        started = time.perf_counter()
        metrics.inflight.inc()
        code, message, rows, queue_seconds, model = grpc.StatusCode.OK, "", 0, None, None
        response = None
        try:
            model = self._loaded(request.model_name, request.model_version)
            parsed = parse_request(request, model.engine, model.tokenizer)
            rows = parsed.rows
            metrics.sequence_length.observe(parsed.seq_len)
            try:
                result = await self.state.batcher.submit(parsed)
            except QueueFull as err:
                raise RequestError(str(err), grpc.StatusCode.RESOURCE_EXHAUSTED) from None
            queue_seconds = result.queue_seconds
            response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
            for name in parsed.outputs:
                add_output(response, name, getattr(result.output, name))
        except RequestError as err:
            code, message = err.code, str(err)
        except Exception:  # noqa: BLE001 - the client gets INTERNAL, the log gets the traceback
            reference = uuid.uuid4().hex[:12]
            log.exception("ModelInfer failed (reference %s)", reference)
            code, message = grpc.StatusCode.INTERNAL, f"internal error (reference {reference} in the server log)"
        finally:
            metrics.inflight.dec()
        elapsed = time.perf_counter() - started
        metrics.requests.labels("ModelInfer", code.name).inc()
        metrics.request_duration.observe(elapsed)
        if queue_seconds is not None:
            metrics.queue_duration.observe(queue_seconds)
        if model is not None:
            model.statistics.record_request(code == grpc.StatusCode.OK, rows, elapsed, queue_seconds)
        if code != grpc.StatusCode.OK:
            await context.abort(code, message)
        return response
