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

import base64
import time

import numpy as np
from aiohttp import web

from ..runtime.errors import FieldError, InputTooLong, ServingError, Unauthenticated, UnknownModel
from . import codec
from .embedding_inputs import (
    EMBEDDING,
    dimensions_field,
    infer_inputs,
    is_large,
    normalizes,
    parse_input,
    shorten,
)
from .http_body import json_response, read_object
from .inference import Inference
from .model import ServedModel

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


