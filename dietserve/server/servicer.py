"""The GRPCInferenceService: v2 health, metadata and inference, plus Triton's extensions.

A thin adapter over the transport-free ``inference.Inference``: each method decodes its message
with ``codec``, calls the core and encodes the answer. Errors are raised as ``runtime.errors``
types; ``status.py`` maps them.
"""

from __future__ import annotations

import time

import grpc

from .. import __version__
from ..runtime.request import EncoderRequest
from . import codec
from ._proto import open_inference_pb2 as pb
from ._proto import open_inference_pb2_grpc as pb_grpc
from .inference import Inference
from .model import ServedModel

SERVER_NAME = "dietserve"
EXTENSIONS = ["model_configuration", "statistics", "parameters"]


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: Inference):
        self.core = core
        self.state = core.state

    # ------------------------------------------------------------------ health and metadata

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        self.core.check_name(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        return self.core.loaded(request.name, request.version).metadata()

    async def ModelConfig(self, request, context):
        model = self.core.loaded(request.name, request.version)
        config = self.state.config
        return pb.ModelConfigResponse(config=model.config(config.batching, config.max_queue_delay_ms))

    async def ModelStatistics(self, request, context):
        if request.name:
            models = [self.core.loaded(request.name, request.version)]
        else:
            models = list(self.state.models.values())
        return pb.ModelStatisticsResponse(model_stats=[model.statistics_proto() for model in models])

    async def RepositoryIndex(self, request, context):
        return pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(name=m.name, version=m.version, state=m.state)
            for m in self.core.repository_index(request.ready)])

    # ------------------------------------------------------------------ inference

    def _parse(self, message: bytes) -> tuple[pb.ModelInferRequest, ServedModel]:
        request = codec.parse_infer_request(message)
        model = self.core.loaded(request.model_name, request.model_version)  # set after the batcher
        codec.check_shapes(request.inputs, model.engine, model.takes_text)
        return request, model

    def _decode(self, message: bytes, deadline: float | None) -> tuple[ServedModel, EncoderRequest, None]:
        request, model = self._parse(message)
        return model, codec.decode(request, self._decoding(request, model, deadline)), None

    def _decoding(self, request: pb.ModelInferRequest, model: ServedModel, deadline: float | None) -> codec.Decoding:
        truncate = self.core.truncate(codec.grpc_truncate(request))
        return codec.Decoding(model.engine, model.tokenizer, truncate, deadline, codec.in_pairs(request.inputs))

    async def _receive(self, message: bytes, context) -> tuple[ServedModel, EncoderRequest, None]:
        """Large messages are parsed and decoded on a worker thread, and text is tokenized
        there, so the event loop stays free for other calls."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        if len(message) > codec.INLINE_MESSAGE_BYTES:
            return await self.core.off_loop(True, self._decode, message, deadline)
        request, model = self._parse(message)
        large = model.takes_text and len(message) > codec.INLINE_TEXT_BYTES
        how = self._decoding(request, model, deadline)
        return model, await self.core.off_loop(large, codec.decode, request, how), None

    async def ModelInfer(self, message: bytes, context):
        """Registered with the message undecoded (see :func:`inference_handlers`)."""
        answer, _ = await self.core.infer(self._receive(message, context))
        model = answer.model
        response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=answer.request.id)
        for name, array in answer.outputs.items():
            codec.add_output(response, name, array)
        return response


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


