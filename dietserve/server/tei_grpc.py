"""Text embeddings inference's (TEI) gRPC services (``protos/tei.proto``, package ``tei.v1``) on
the inference server's gRPC port, beside the v2 service: Info, Embed, Predict, Rerank and
Tokenize, for clients of TEI's gRPC image.

Each method turns its message into the JSON body TEI's HTTP route takes and calls the same
``tei_calls.TeiCalls`` / ``rerank_api.ClassifierCalls`` code, so both wires check and answer
alike; errors are mapped by ``status.py`` as on every RPC. TEI serves one model: here the call's
``model`` metadata names one where the server serves several. ``truncate`` is a plain bool in
proto3, so false means the server's default (``--truncate``), as an omitted field does over HTTP.

A stream's messages run at once, up to :data:`STREAM_IN_FLIGHT` ahead of the answer the client
is waiting for, so the batcher batches them; answers come back in the messages' order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from ..runtime.errors import FieldError
from ._proto import tei_pb2 as tei
from ._proto import tei_pb2_grpc as tei_grpc
from .inference import Answer, Inference
from .rerank_api import ClassifierCalls
from .tei_calls import TeiCalls, nonzero_weights

SERVICES = tuple(service.full_name for service in tei.DESCRIPTOR.services_by_name.values())
# A stream's messages running at once (TEI's GRPC_MAX_PARALLEL_STREAM_REQUESTS): at most this, and
# at most a quarter of --max-queue-rows, so that one stream cannot fill the queue and see its
# messages refused.
STREAM_IN_FLIGHT = 64
MODEL_METADATA = "model"
MODEL_TYPES = {"embedding": tei.MODEL_TYPE_EMBEDDING, "classifier": tei.MODEL_TYPE_CLASSIFIER,
               "reranker": tei.MODEL_TYPE_RERANKER}
DIRECTION_NAMES = {tei.TRUNCATION_DIRECTION_RIGHT: "right", tei.TRUNCATION_DIRECTION_LEFT: "left"}


def _named_model(context: grpc.aio.ServicerContext) -> str | None:
    return next((value for key, value in context.invocation_metadata() or () if key == MODEL_METADATA), None)


def _options(message, *optional: str) -> dict:
    """The HTTP body's options of ``message``: truncate (false: the server's default), its
    direction, raw_scores where the message has it, and each ``optional`` field it sets."""
    options = {"truncate": message.truncate or None,
               "truncation_direction": DIRECTION_NAMES.get(message.truncation_direction, "right")}
    if "raw_scores" in message.DESCRIPTOR.fields_by_name:
        options["raw_scores"] = message.raw_scores
    return options | {name: getattr(message, name) for name in optional if message.HasField(name)}


def _metadata(started: float, chars: int, answers: Sequence[Answer] = (), tokens: int | None = None) -> tei.Metadata:
    """What an answer computed and where its time went: tokens, queue and inference times from the
    call's ``answers`` where they are at hand (the embedding calls), else ``tokens``; tokenization
    is not timed apart here."""
    return tei.Metadata(compute_chars=chars,
                        compute_tokens=tokens if tokens is not None else sum(a.request.tokens for a in answers),
                        total_time_ns=int((time.perf_counter() - started) * 1e9),
                        queue_time_ns=int(max((answer.queue_seconds for answer in answers), default=0) * 1e9),
                        inference_time_ns=int(max((answer.compute_seconds for answer in answers), default=0) * 1e9))


async def in_order(messages: AsyncIterator, call: Callable[[object], Awaitable], limit: int) -> AsyncIterator:
    """``call(message)`` for each message of a stream, up to ``limit`` at once; the answers in
    the messages' order. The first failure ends the stream with its error."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=limit)

    async def read() -> None:
        try:
            async for message in messages:
                await queue.put(asyncio.ensure_future(call(message)))
        finally:
            await queue.put(None)

    reader = asyncio.ensure_future(read())
    try:
        while (task := await queue.get()) is not None:
            yield await task
        await reader  # a failure reading the stream
    finally:
        reader.cancel()
        while not queue.empty():
            task = queue.get_nowait()
            if task is not None:
                task.cancel()


def _streamed(method: str):
    """The stream form of the unary method ``method``: its answer to each message, in order."""
    async def stream(self, requests, context):
        async for response in in_order(requests, lambda message: getattr(self, method)(message, context),
                                       self.read_ahead):
            yield response
    return stream


class TeiServicer:
    """The five services' methods; one object registered as each."""

    def __init__(self, core: Inference):
        self.core = core
        self.read_ahead = max(1, min(STREAM_IN_FLIGHT, core.state.config.max_queue_rows // 4))
        self.calls = TeiCalls(core)
        self.classify = ClassifierCalls(core)

    # ------------------------------------------------------------------ Info

    async def Info(self, request, context):
        info = self.calls.info(_named_model(context))
        return tei.InfoResponse(
            version=info["version"], model_id=info["model_id"], model_dtype=info["model_dtype"],
            model_type=MODEL_TYPES[next(iter(info["model_type"]))],
            max_concurrent_requests=info["max_concurrent_requests"], max_input_length=info["max_input_length"],
            max_batch_tokens=info["max_batch_tokens"], max_batch_requests=info["max_batch_requests"],
            max_client_batch_size=info["max_client_batch_size"], tokenization_workers=info["tokenization_workers"])

    # ------------------------------------------------------------------ Embed

    async def Embed(self, message, context) -> tei.EmbedResponse:
        started = time.perf_counter()
        body = {"inputs": message.inputs, **_options(message, "normalize", "prompt_name", "dimensions")}
        embeddings, answers = await self.calls.embeddings(body, _named_model(context), message.ByteSize())
        return tei.EmbedResponse(embeddings=embeddings[0].tolist(),
                                 metadata=_metadata(started, len(message.inputs), answers))

    async def EmbedSparse(self, message, context) -> tei.EmbedSparseResponse:
        started = time.perf_counter()
        body = {"inputs": message.inputs, **_options(message, "prompt_name")}
        weights, answers = await self.calls.sparse_weights(body, _named_model(context), message.ByteSize())
        indices, values = nonzero_weights(weights)[0]
        entries = [tei.SparseValue(index=int(i), value=float(v)) for i, v in zip(indices, values, strict=True)]
        return tei.EmbedSparseResponse(sparse_embeddings=entries,
                                       metadata=_metadata(started, len(message.inputs), answers))

    async def EmbedAll(self, message, context) -> tei.EmbedAllResponse:
        started = time.perf_counter()
        body = {"inputs": message.inputs, **_options(message, "prompt_name")}
        hidden, answers = await self.calls.token_embeddings(body, _named_model(context), message.ByteSize())
        return tei.EmbedAllResponse(token_embeddings=[tei.TokenEmbedding(embeddings=row) for row in hidden[0].tolist()],
                                    metadata=_metadata(started, len(message.inputs), answers))

    EmbedStream = _streamed("Embed")
    EmbedSparseStream = _streamed("EmbedSparse")
    EmbedAllStream = _streamed("EmbedAll")

    # ------------------------------------------------------------------ Predict

    async def Predict(self, message, context) -> tei.PredictResponse:
        started = time.perf_counter()
        inputs = message.inputs
        if not isinstance(inputs, str) and len(inputs) != 2:
            raise FieldError("inputs", f"PredictPair takes two texts (a text and its pair), got {len(inputs)}")
        body = {"inputs": inputs if isinstance(inputs, str) else list(inputs), **_options(message)}
        answers, _, tokens = await self.classify.predictions(body, _named_model(context), False)
        chars = len(inputs) if isinstance(inputs, str) else sum(map(len, inputs))
        return tei.PredictResponse(predictions=[tei.Prediction(score=entry["score"], label=entry["label"])
                                                for entry in answers[0]],
                                   metadata=_metadata(started, chars, tokens=tokens))

    PredictStream = _streamed("Predict")
    PredictPair = Predict
    PredictPairStream = _streamed("Predict")

    # ------------------------------------------------------------------ Rerank

    @staticmethod
    def _ranked(ranks: list[dict], tokens: int, chars: int, started: float) -> tei.RerankResponse:
        return tei.RerankResponse(ranks=[tei.Rank(index=rank["index"], score=rank["score"], text=rank.get("text"))
                                         for rank in ranks],
                                  metadata=_metadata(started, chars, tokens=tokens))

    async def Rerank(self, request, context):
        started = time.perf_counter()
        body = {"query": request.query, "texts": list(request.texts), "return_text": request.return_text,
                **_options(request)}
        ranks, tokens = await self.classify.ranks(body, _named_model(context), False)
        return self._ranked(ranks, tokens, len(request.query) * len(request.texts) + sum(map(len, request.texts)),
                            started)

    async def RerankStream(self, requests, context):
        """Each message is a (query, text) pair; its first message's raw_scores and return_text
        hold for all."""
        started, messages = time.perf_counter(), [message async for message in requests]
        if not messages:
            raise FieldError("texts", "the stream held no (query, text) pair to rank")
        pairs = [(message.query, message.text) for message in messages]
        options = {**_options(messages[0]), "return_text": messages[0].return_text}
        ranks, tokens = await self.classify.pair_ranks(pairs, options, _named_model(context), False)
        return self._ranked(ranks, tokens, sum(len(query) + len(text) for query, text in pairs), started)

    # ------------------------------------------------------------------ Tokenize

    async def Tokenize(self, request, context):
        body = {"inputs": request.inputs, "add_special_tokens": request.add_special_tokens}
        if request.HasField("prompt_name"):
            body["prompt_name"] = request.prompt_name
        tokens = (await self.calls.tokens(body, _named_model(context), request.ByteSize()))[0]
        return tei.EncodeResponse(tokens=[tei.SimpleToken(**token) for token in tokens])

    TokenizeStream = _streamed("Tokenize")

    async def Decode(self, request, context):
        body = {"ids": list(request.ids), "skip_special_tokens": request.skip_special_tokens}
        texts = await self.calls.decoded(body, _named_model(context), request.ByteSize())
        return tei.DecodeResponse(text=texts[0])

    DecodeStream = _streamed("Decode")

def add_tei_services(server: grpc.aio.Server, core: Inference) -> None:
    servicer = TeiServicer(core)
    for add in (tei_grpc.add_InfoServicer_to_server, tei_grpc.add_EmbedServicer_to_server,
                tei_grpc.add_PredictServicer_to_server, tei_grpc.add_RerankServicer_to_server,
                tei_grpc.add_TokenizeServicer_to_server):
        add(servicer, server)
