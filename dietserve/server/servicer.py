"""The GRPCInferenceService: v2 health, metadata and inference, plus Triton's extensions.

A thin adapter: each method looks up the model, decodes with ``codec``, calls the batcher and
encodes the answer. Errors are raised as ``runtime.errors`` types; ``status.py`` maps them.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from .. import __version__
from ..runtime.batcher import DynamicBatcher
from ..runtime.errors import NotReady, ReplyTooLarge, UnknownModel
from . import codec
from ._proto import open_inference_pb2 as pb
from ._proto import open_inference_pb2_grpc as pb_grpc
from .config import ServerConfig
from .metrics import ServerMetrics
from .model import VERSION, ServedModel

SERVER_NAME = "dietserve"
EXTENSIONS = ["model_configuration", "statistics", "parameters"]
DECODE_THREADS = 2  # tokenizing and large tensors; bounded so decoding cannot starve the kernels


@dataclass
class ServingState:
    """What the servicer serves; ``models`` and ``batcher`` are set once loading finishes."""

    config: ServerConfig
    metrics: ServerMetrics
    model_names: tuple[str, ...]  # known from the start, so requests during loading get UNAVAILABLE
    models: dict[str, ServedModel] = field(default_factory=dict)
    batcher: DynamicBatcher | None = None
    ready: bool = False
    decode_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="dietserve-decode"))


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServingState):
        self.state = state

    def _check_name(self, name: str, version: str) -> None:
        if name not in self.state.model_names:
            served = ", ".join(f"'{n}'" for n in self.state.model_names)
            raise UnknownModel(f"unknown model '{name}'; this server serves {served}")
        model = self.state.models.get(name)
        served_version = model.version if model is not None else VERSION
        if version not in ("", served_version):
            raise UnknownModel(f"model '{name}' has no version '{version}' (serving version {served_version})")

    def _loaded(self, name: str, version: str) -> ServedModel:
        self._check_name(name, version)
        model = self.state.models.get(name)
        if model is None:
            raise NotReady(f"model '{name}' is still loading")
        return model

    # ------------------------------------------------------------------ health and metadata

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        self._check_name(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        return self._loaded(request.name, request.version).metadata()

    async def ModelConfig(self, request, context):
        model = self._loaded(request.name, request.version)
        config = self.state.config
        buckets = self.state.batcher.edges if self.state.batcher is not None else []
        return pb.ModelConfigResponse(config=model.config(config.batching, config.max_queue_delay_ms, buckets))

    async def ModelStatistics(self, request, context):
        if request.name:
            models = [self._loaded(request.name, request.version)]
        else:
            models = list(self.state.models.values())
        return pb.ModelStatisticsResponse(model_stats=[model.statistics_proto() for model in models])

    async def RepositoryIndex(self, request, context):
        if self.state.ready:
            state = "READY"
        else:
            state = "LOADING" if not self.state.models else "UNAVAILABLE"
        if request.ready and state != "READY":
            return pb.RepositoryIndexResponse()
        versions = {name: model.version for name, model in self.state.models.items()}
        return pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(name=name, version=versions.get(name, VERSION), state=state)
            for name in self.state.model_names])

    # ------------------------------------------------------------------ inference

    def _parse(self, message: bytes) -> tuple[pb.ModelInferRequest, ServedModel]:
        request = codec.parse_infer_request(message)
        model = self._loaded(request.model_name, request.model_version)  # set after the batcher
        codec.check_shapes(request, model.engine, model.takes_text)
        return request, model

    def _decode(self, message: bytes, deadline: float | None):
        request, model = self._parse(message)
        return request, model, codec.decode(request, model.engine, model.tokenizer, deadline)

    async def _receive(self, message: bytes, context):
        """(request, model, encoder request); large messages are parsed and decoded on a worker
        thread, and text is tokenized there, so the event loop stays free for other calls."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        pool, loop = self.state.decode_pool, asyncio.get_running_loop()
        if len(message) > codec.INLINE_MESSAGE_BYTES:
            return await loop.run_in_executor(pool, self._decode, message, deadline)
        request, model = self._parse(message)
        if model.takes_text and len(message) > codec.INLINE_TEXT_BYTES:
            encoder_request = await loop.run_in_executor(
                pool, codec.decode, request, model.engine, model.tokenizer, deadline)
        else:
            encoder_request = codec.decode(request, model.engine, model.tokenizer, deadline)
        return request, model, encoder_request

    async def ModelInfer(self, message: bytes, context):
        """Registered with the message undecoded (see :func:`inference_handlers`)."""
        state, metrics = self.state, self.state.metrics
        started = time.perf_counter()
        metrics.inflight.inc()
        ok, rows, queue_seconds, compute_seconds, model = False, 0, None, None, None
        try:
            request, model, encoder_request = await self._receive(message, context)
            rows = encoder_request.rows
            reply = encoder_request.reply_bytes(model.engine.hidden_size)
            if reply > state.config.max_response_bytes:
                raise ReplyTooLarge(
                    f"the answer would be {reply} bytes, over this server's limit of {state.config.max_response_bytes} "
                    "(--max-response-bytes); request fewer rows or only sentence_embedding")
            result = await state.batcher.submit(encoder_request)
            queue_seconds, compute_seconds = result.queue_seconds, result.run.compute_seconds
            model.statistics.record_execution(result.run)
            response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
            for name in encoder_request.outputs:
                codec.add_output(response, name, getattr(result.output, name))
            ok = True
            return response
        finally:
            metrics.inflight.dec()
            elapsed = time.perf_counter() - started
            metrics.request_duration.observe(elapsed)
            if queue_seconds is not None:
                metrics.queue_duration.observe(queue_seconds)
            if model is not None:
                model.statistics.record_request(ok, rows, elapsed, queue_seconds, compute_seconds)


# Methods registered without a request deserializer: their handler parses the message itself,
# because parsing a 16 MiB request takes tens of milliseconds that must not block the event loop.
RAW_REQUEST_METHODS = ("ModelInfer",)


def inference_handlers(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The GRPCInferenceService's handlers, as the generated registration builds them, except
    for :data:`RAW_REQUEST_METHODS`."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        request_type, response_type = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=None if method.name in RAW_REQUEST_METHODS else request_type.FromString,
            response_serializer=response_type.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


