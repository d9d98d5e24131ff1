"""Text embeddings inference's (TEI) embedding routes, for clients written against TEI
(huggingface_hub's ``InferenceClient``, LangChain's Hugging Face endpoint embeddings):
``POST /embed``, ``/embed_sparse`` (a SPLADE encoder's nonzero weights of the vocabulary),
``/embed_all``, ``/similarity``, ``/tokenize``, ``/decode``, ``GET /info``, and ``POST /`` with
its SageMaker name ``/invocations``. TEI answers ``/`` by what its one model is;
here the body decides: a ``query`` is reranked, ``inputs`` holding a ``source_sentence`` are
compared, other ``inputs`` are embedded by an embedding model and classified by a classifier.
TEI's classifier routes, ``/rerank`` and ``/predict``, are in ``rerank_api.py``; both modules
pick the model with ``tei_calls.chosen_model``, from the name :func:`named_model` reads.

Errors carry TEI's ``error_type`` beside the message; the status codes are this server's, as on
every route. The checks and the work are ``tei_calls.py``'s, shared with TEI's gRPC services.
"""

from __future__ import annotations

from aiohttp import web

from ..runtime.errors import FieldError
from . import codec
from .http_body import JSON_TYPE, dumps, json_response, read_object
from .inference import Inference
from .tei_calls import TeiCalls, nonzero_weights, string_field

# The routes whose errors take TEI's shape, and TEI's name for the kind of each error.
TEI_ROUTES = frozenset({"/", "/invocations", "/embed", "/embed_sparse", "/embed_all", "/similarity", "/tokenize",
                        "/decode", "/info", "/rerank", "/predict"})
ERROR_TYPES = {429: "Overloaded", 503: "Unhealthy"}  # other 4xx: Validation; 5xx: Backend


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "Validation" if status < 500 else "Backend")
    return {"error": message, "error_type": kind}


def named_model(request: web.Request, body: dict) -> str | None:
    """The model a TEI route's request names: ``model`` in the body, else ``?model=``, else none."""
    return request.query.get("model") if "model" not in body else string_field(body, "model")


class TeiRoutes:
    """TEI's embedding routes over :class:`TeiCalls`; ``rerank`` and ``predict``, the classifier
    routes' handlers, are what ``POST /`` hands a classifier's body to."""

    def __init__(self, core: Inference, rerank, predict):
        self.core = core
        self.config = core.state.config
        self.calls = TeiCalls(core)
        self._rerank, self._predict = rerank, predict

    def add_to(self, app: web.Application) -> None:
        for path in ("/", "/invocations"):
            app.router.add_post(path, self.root)
        app.router.add_post("/embed", self.embed)
        app.router.add_post("/embed_sparse", self.embed_sparse)
        app.router.add_post("/embed_all", self.embed_all)
        app.router.add_post("/similarity", self.similarity)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/decode", self.decode)
        app.router.add_get("/info", self.info)

    async def _body(self, request: web.Request) -> tuple[dict, str | None, int]:
        """The JSON body, the model it names and its size in bytes."""
        body, raw = await read_object(request, self.config.max_request_bytes, self.config.http_body_timeout_seconds)
        return body, named_model(request, body), len(raw)

    async def root(self, request: web.Request) -> web.Response:
        """A ``query`` is reranked, ``inputs`` holding a ``source_sentence`` compared; other
        ``inputs`` go to /predict, /embed_sparse or /embed, by the named model's kind or, where
        none is named, the kind every served model is. The handler it hands to finds the body
        parsed already."""
        body, name, _ = await self._body(request)
        if "query" in body:
            return await self._rerank(request)
        if isinstance(body.get("inputs"), dict):
            return await self.similarity(request)
        models = [self.core.model_for(name, takes_text=True)] if name is not None else self.core.text_models()
        kinds = {model.engine.is_classifier for model in models}
        if len(kinds) != 1:
            raise FieldError("model", f"{request.path} serves one model's kind, and this server serves embedding "
                                      "models and classifiers: name one with 'model' in the body or ?model= in "
                                      "the URL, or use /embed, /predict or /rerank")
        if kinds.pop():
            return await self._predict(request)
        sparse = {model.engine.sparse for model in models}
        return await (self.embed_sparse(request) if sparse == {True} else self.embed(request))

    async def similarity(self, request: web.Request) -> web.Response:
        return json_response(await self.calls.similarity(*await self._body(request)))

    async def embed(self, request: web.Request) -> web.Response:
        embeddings, _ = await self.calls.embeddings(*await self._body(request))
        return await self._answer(embeddings.nbytes, embeddings.tolist)

    async def embed_sparse(self, request: web.Request) -> web.Response:
        """Per input, ``[{index, value}, ...]`` in vocabulary order."""
        weights, _ = await self.calls.sparse_weights(*await self._body(request))

        def entries() -> list:
            return [[{"index": int(i), "value": float(v)} for i, v in zip(indices, values, strict=True)]
                    for indices, values in nonzero_weights(weights)]

        return await self._answer(weights.nbytes, entries)

    async def embed_all(self, request: web.Request) -> web.Response:
        hidden, _ = await self.calls.token_embeddings(*await self._body(request))
        return await self._answer(4 * sum(rows.size for rows in hidden), lambda: [rows.tolist() for rows in hidden])

    async def _answer(self, size: int, value) -> web.Response:
        """JSON of ``value()``, made off the event loop when ``size`` bytes of floats make it slow."""
        payload = await self.core.off_loop(size > codec.INLINE_MESSAGE_BYTES, lambda: dumps(value()))
        return web.Response(body=payload, content_type=JSON_TYPE)

    async def tokenize(self, request: web.Request) -> web.Response:
        return json_response(await self.calls.tokens(*await self._body(request)))

    async def decode(self, request: web.Request) -> web.Response:
        return json_response(await self.calls.decoded(*await self._body(request)))

    async def info(self, request: web.Request) -> web.Response:
        """For the model ``?model=`` names or the only one."""
        return json_response(self.calls.info(request.query.get("model")))
