"""OpenAI's embeddings API (``POST /v1/embeddings``, ``GET /v1/models``) and ``GET /health``
(also ``/ping``).

``input`` is a string, a list of strings (tokenized by the server, as the ``-text`` model), a list
of token ids or a list of such lists (run as given, as the ids model: the caller's ids include
any special tokens). ``model`` picks the artifact: either of its two models' names is accepted.
A request with more inputs than the model's batch bound is split into batch-sized requests,
which the batcher may run together.

``dimensions``: the first N dimensions of each sentence embedding, L2-normalised again when the
model normalises its embeddings (a shortened unit vector stays a unit vector, as OpenAI's
text-embedding-3 models shorten theirs); as they are otherwise. ``truncate`` (not OpenAI's): cut
inputs over the model's maximum length instead of refusing them (default: ``--truncate``).
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from aiohttp import web

from ..runtime.errors import InputTooLong, ServingError, Unauthenticated, UnknownModel
from ..runtime.request import EncoderRequest
from . import codec
from .http_body import FieldError, json_response, read_object
from .inference import Answer, Inference
from .model import ServedModel

EMBEDDING = "sentence_embedding"
ENCODINGS = ("float", "base64")
# OpenAI's error codes and the body field at fault, for the errors it has; other errors have none.
ERROR_CODES: dict[type[ServingError], tuple[str, str]] = {
    InputTooLong: ("context_length_exceeded", "input"), UnknownModel: ("model_not_found", "model"),
    Unauthenticated: ("invalid_api_key", None)}


def error_body(status: int, message: str, err: Exception | None) -> dict:
    """OpenAI's error shape, which its clients parse into their exceptions."""
    code, param = next((known for kind, known in ERROR_CODES.items() if isinstance(err, kind)), (None, None))
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": getattr(err, "param", param), "code": code}}


def token_lists(value: list) -> list[list[int]] | None:
    """``value`` as token id sequences, or None if it is not made of integers."""
    def ints(items: list) -> bool:
        return all(isinstance(i, int) and not isinstance(i, bool) for i in items)

    if ints(value):
        return [value]
    if all(isinstance(item, list) for item in value) and all(ints(item) for item in value):
        return value
    return None


def parse_input(value: object, field: str = "input") -> list[str] | list[list[int]]:
    """A string, strings, token ids or lists of token ids -> texts or token id sequences;
    ``field`` names the body field in errors."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise FieldError(field, f"{field} must be a string, a list of strings, a list of token ids or a list of "
                                "lists of token ids, and not empty")
    if all(isinstance(item, str) for item in value):
        return value
    tokens = token_lists(value)
    if tokens is None:
        raise FieldError(field, f"{field} mixes types: give strings only, or token ids (integers) only")
    for index, sequence in enumerate(tokens):
        if not sequence:
            raise FieldError(field, f"{field}[{index}] is an empty list of token ids")
    return tokens


class EmbeddingsRequest:
    """The body's fields, checked."""

    def __init__(self, body: dict, served: tuple[str, ...]):
        self.model = body.get("model")  # None: the only embedding model served (as vLLM and TEI take it)
        if self.model is not None and not isinstance(self.model, str):
            raise FieldError("model", "model must name a served model: " + ", ".join(served))
        if "input" not in body:
            raise FieldError("input", "the body needs 'input': the text(s) or token ids to embed")
        self.inputs = parse_input(body["input"])
        self.takes_text = isinstance(self.inputs[0], str)
        self.encoding = body.get("encoding_format") or "float"
        if self.encoding not in ENCODINGS:
            raise FieldError("encoding_format", f"encoding_format must be 'float' or 'base64', got {self.encoding!r}")
        self.dimensions = dimensions_field(body)
        self.truncate = codec.check_truncate(body.get(codec.TRUNCATE_PARAMETER))


def dimensions_field(body: dict) -> int | None:
    """``dimensions``: how many of each embedding's first dimensions to answer (None: all)."""
    value = body.get("dimensions")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise FieldError("dimensions", f"dimensions must be a positive integer, got {value!r}")
    return value


def _ids_rows(sequences: list[list[int]], max_length: int, truncate: bool, first: int, keep_last: bool = False):
    """Token id sequences -> padded ids and mask (rows from input ``first`` on); truncation
    keeps each sequence's first ids, or its last with ``keep_last``."""
    for index, sequence in enumerate(sequences):
        if len(sequence) > max_length and not truncate:
            raise InputTooLong(f"input[{first + index}] has {len(sequence)} tokens, over the model's maximum of "
                               f"{max_length}; shorten it, or send truncate=true to embed its first {max_length}")
    rows = [sequence[-max_length:] if keep_last else sequence[:max_length] for sequence in sequences]
    seq = max(len(row) for row in rows)
    ids, mask = np.zeros((len(rows), seq), np.int64), np.zeros((len(rows), seq), np.int64)
    for index, row in enumerate(rows):
        try:
            ids[index, : len(row)] = row
        except OverflowError:
            raise FieldError("input", f"input[{first + index}] holds a token id outside int64") from None
        mask[index, : len(row)] = 1
    return ids, mask


def shorten(embeddings: np.ndarray, dimensions: int | None, normalized: bool) -> np.ndarray:
    """The first ``dimensions`` of each row; re-normalised if the model normalises."""
    if dimensions is None or dimensions == embeddings.shape[1]:
        return embeddings
    if dimensions > embeddings.shape[1]:
        raise FieldError("dimensions", f"dimensions is {dimensions}, over this model's {embeddings.shape[1]}")
    short = embeddings[:, :dimensions]
    return l2_normalized(short) if normalized else short


def l2_normalized(embeddings: np.ndarray) -> np.ndarray:
    """Each row over its L2 norm, as torch.nn.functional.normalize: x / max(||x||, 1e-12)."""
    norms = np.linalg.norm(embeddings.astype(np.float64), axis=1, keepdims=True)
    return (embeddings / np.maximum(norms, 1e-12)).astype(np.float32)


def encode_embeddings(embeddings: np.ndarray, parsed: EmbeddingsRequest, tokens: int) -> dict:
    def encoded(row: np.ndarray):
        if parsed.encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
            return base64.b64encode(np.ascontiguousarray(row, "<f4").tobytes()).decode()
        return row.tolist()

    data = [{"object": "embedding", "index": i, "embedding": encoded(row)} for i, row in enumerate(embeddings)]
    return {"object": "list", "data": data, "model": parsed.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class OpenAIRoutes:
    def __init__(self, core: Inference):
        self.core = core
        self.config = core.state.config
        self.started = int(time.time())

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        for path in ("/health", "/ping"):  # /ping: SageMaker's name, which TEI answers too
            app.router.add_get(path, self.health)

    async def health(self, request: web.Request) -> web.Response:
        ready = self.core.state.ready
        return json_response({"status": "ready" if ready else "not ready"}, 200 if ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.started, "owned_by": "dietserve"}
            for name in self.core.state.model_names]})

    def _model(self, parsed: EmbeddingsRequest) -> ServedModel:
        """The named model's artifact (without a name, the only embedding model's; ``parsed.model``
        then names it), as its text or its ids model by the input's kind."""
        if parsed.model is None:
            embedders = [model.artifact for model in self.core.text_models() if not model.engine.is_classifier]
            if len(embedders) != 1:
                served = ", ".join(f"'{name}'" for name in embedders) or "none"
                raise FieldError("model", "the body needs 'model' when the server serves other than one embedding "
                                          f"model; embedding models served: {served}")
            parsed.model = embedders[0]
        return self.core.model_for(parsed.model, parsed.takes_text)

    async def embeddings(self, request: web.Request) -> web.Response:
        fields, body = await read_object(request, self.config.max_request_bytes, self.config.http_body_timeout_seconds)
        parsed = EmbeddingsRequest(fields, self.core.state.model_names)
        model = self._model(parsed)
        if model.engine.is_classifier:
            raise FieldError("model", f"the served model '{parsed.model}' is a classifier (cross-encoder), not an "
                                      "embedding model: it gives scores, not embeddings; use /rerank, /v1/rerank or "
                                      "/predict")
        if model.engine.sparse and parsed.dimensions is not None:
            raise FieldError("dimensions", f"'{parsed.model}' is a sparse encoder (SPLADE): its weights are the "
                                           "vocabulary's, whose first entries are no shorter embedding; leave "
                                           "dimensions out, or use /embed_sparse for the nonzero weights")
        large = is_large(len(body), parsed.takes_text)
        answers = await infer_inputs(self.core, model, parsed.inputs, parsed.truncate, large, (EMBEDDING,))
        embeddings = np.concatenate([answer.outputs[EMBEDDING] for answer in answers])
        embeddings = shorten(embeddings, parsed.dimensions, normalizes(model))
        tokens = sum(answer.request.tokens for answer in answers)
        return json_response(await self.core.off_loop(large, encode_embeddings, embeddings, parsed, tokens))


def is_large(size: int, takes_text: bool) -> bool:
    """Whether a request of ``size`` bytes is worth decoding off the event loop (``Inference.off_loop``)."""
    return size > (codec.INLINE_TEXT_BYTES if takes_text else codec.INLINE_MESSAGE_BYTES)


async def infer_inputs(core: Inference, model: ServedModel, inputs: list, truncate: bool | None, large: bool,
                       outputs: tuple[str, ...], keep_last: bool = False) -> list[Answer]:
    """Texts or token id sequences (``parse_input``) through ``model`` (its text or its ids
    model, as the inputs are), in batch-sized requests the batcher may run together; the
    answers in the inputs' order. ``keep_last``: truncation keeps the last tokens."""
    step, truncate = model.engine.max_batch, core.truncate(truncate)

    async def received(first: int) -> tuple[ServedModel, EncoderRequest, None]:
        chunk = inputs[first : first + step]
        request = await core.off_loop(large, decode_inputs, model, chunk, first, truncate, outputs, keep_last)
        return model, request, None

    answers = await asyncio.gather(*(core.infer(received(first)) for first in range(0, len(inputs), step)))
    return [answer for answer, _ in answers]


def decode_inputs(model: ServedModel, inputs: list, first: int, truncate: bool, outputs: tuple[str, ...],
                  keep_last: bool = False) -> EncoderRequest:
    """Texts (tokenized as the ``-text`` model's) or token id sequences (run as given) -> a
    request; ``first`` numbers the inputs in messages as the client's request does."""
    if isinstance(inputs[0], str):
        # Lone surrogates (JSON allows them) pass through to codec's UTF-8 check, which names them.
        tensor = codec.InputTensor(codec.TEXT_INPUT, "BYTES", [len(inputs)],
                                   values=[text.encode("utf-8", "surrogatepass") for text in inputs])
        how = codec.Decoding(model.engine, model.tokenizer, truncate, first=first, keep_last=keep_last)
        return codec.encoder_request(codec.decode_tensors([tensor]), outputs, how)
    ids, mask = _ids_rows(inputs, model.max_input_tokens, truncate, first, keep_last)
    ids, mask, types = model.engine.validate(ids, mask)
    return EncoderRequest(ids, mask, types, outputs)


def normalizes(model: ServedModel) -> bool:
    """Whether the model's graph L2-normalises its sentence embeddings (a Normalize module)."""
    return bool(model.engine.artifact.manifest.normalize_embeddings)


